from shop.cart import Cart

__all__ = ["Cart"]
