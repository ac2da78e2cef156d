import unittest

from calendar_tools import is_leap_year


class LeapTest(unittest.TestCase):
    def test_century(self):
        self.assertFalse(is_leap_year(1900))


if __name__ == "__main__":
    unittest.main()
