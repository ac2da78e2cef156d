import unittest

from textkit import slugify


class SlugTest(unittest.TestCase):
    def test_punctuation(self):
        self.assertEqual(slugify("Hello,  World!"), "hello-world")


if __name__ == "__main__":
    unittest.main()
