"""``Records``: a dict of the last ``MAX_KEYS`` exchange keys, so what peers send never grows a peer's memory."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

MAX_KEYS = 4096
"""How many exchange keys each agreement record remembers (oldest forgotten first)."""

K = TypeVar("K")
V = TypeVar("V")


class Records(Generic[K, V]):
    """A dict that forgets its oldest keys past ``limit`` (bounded memory whatever peers send)."""

    def __init__(self, limit: int = MAX_KEYS):
        self.limit = limit
        self._items: OrderedDict[K, V] = OrderedDict()

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def get(self, key: K, default=None):
        return self._items.get(key, default)

    def pop(self, key: K, default=None):
        return self._items.pop(key, default)

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def values(self):
        return self._items.values()

    def items(self):
        return self._items.items()
