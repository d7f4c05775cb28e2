"""Stock levels for a small shop: what is on the shelves and what to reorder."""

from dataclasses import dataclass


@dataclass
class Item:
    sku: str
    name: str
    quantity: int
    reorder_level: int
    unit_price: float


def total_value(items):
    """The value of everything in stock, at unit price."""
    value = 0.0
    for item in items:
        value += item.quantity * item.unit_price
    return value


def items_to_reorder(items):
    """The items whose quantity has fallen to or below their reorder level."""
    low = []
    for item in items:
        if item.quantity <= item.reorder_level:
            low.append(item)
    return low


def remove_stock(items, sku, count):
    """Take `count` units of the item `sku` off the shelf; False when there are not enough."""
    for item in items:
        if item.sku == sku:
            if item.quantity < count:
                return False
            item.quantity -= count
            return True
    raise KeyError(sku)


def restock(items, sku, count):
    """Add `count` units of the item `sku` to the shelf."""
    for item in items:
        if item.sku == sku:
            item.quantity += count
            return item.quantity
    raise KeyError(sku)
