import unittest

from textkit import slugify


class HiddenSlugTest(unittest.TestCase):
    def test_cases(self):
        self.assertEqual(slugify("Hello,  World!"), "hello-world")
        self.assertEqual(slugify("  Ray RL 2 go  "), "ray-rl-2-go")
        self.assertEqual(slugify("a--b"), "a-b")
        self.assertEqual(slugify("Already-slug"), "already-slug")
        self.assertEqual(slugify("!!!"), "")
