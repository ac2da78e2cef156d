import unittest

from stats import mean, median


class HiddenMeanTest(unittest.TestCase):
    def test_values(self):
        self.assertEqual(mean([1, 2, 3]), 2.0)
        self.assertEqual(mean([10]), 10.0)
        self.assertAlmostEqual(mean([0.5, 1.5, 2.5, 3.5]), 2.0)
        self.assertEqual(mean([-4, 4]), 0.0)

    def test_empty(self):
        with self.assertRaises(ValueError):
            mean([])

    def test_median_untouched(self):
        self.assertEqual(median([3, 1, 2]), 2)
        self.assertEqual(median([4, 1, 2, 3]), 2.5)
