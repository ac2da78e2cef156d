import unittest

from stats import mean


class MeanTest(unittest.TestCase):
    def test_small_list(self):
        self.assertEqual(mean([1, 2, 3]), 2.0)


if __name__ == "__main__":
    unittest.main()
