"""A shopping cart."""


class Cart:
    def __init__(self):
        self._items = {}

    def add(self, item, count=1):
        if count <= 0:
            raise ValueError("count must be positive")
        self._items[item] = count

    def quantity(self, item):
        return self._items.get(item, 0)

    def total_items(self):
        return sum(self._items.values())
