import unittest

from shop import Cart


class HiddenCartTest(unittest.TestCase):
    def test_adds_up(self):
        cart = Cart()
        cart.add("pen", 2)
        cart.add("pen", 3)
        cart.add("ink")
        self.assertEqual(cart.quantity("pen"), 5)
        self.assertEqual(cart.quantity("ink"), 1)
        self.assertEqual(cart.total_items(), 6)

    def test_bad_count(self):
        with self.assertRaises(ValueError):
            Cart().add("pen", 0)
