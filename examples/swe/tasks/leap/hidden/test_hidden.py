import unittest

from calendar_tools import days_in_year, is_leap_year


class HiddenLeapTest(unittest.TestCase):
    def test_rules(self):
        for year, leap in [(1900, False), (2000, True), (2024, True), (2023, False), (2100, False), (1600, True)]:
            self.assertEqual(is_leap_year(year), leap, year)

    def test_days(self):
        self.assertEqual(days_in_year(1900), 365)
        self.assertEqual(days_in_year(2000), 366)
