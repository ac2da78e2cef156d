import unittest

from shop import Cart


class CartTest(unittest.TestCase):
    def test_add_twice(self):
        cart = Cart()
        cart.add("pen", 2)
        cart.add("pen", 3)
        self.assertEqual(cart.quantity("pen"), 5)


if __name__ == "__main__":
    unittest.main()
