"""Endpoint pool with SIEVE eviction (Zhang et al., NSDI'24), as in Mooncake's transfer engine.

An endpoint is the connected QP(s) between one local NIC and one remote NIC of one peer. Endpoints
are made on first use; when the pool is full the SIEVE hand evicts one that was not used since the
hand last passed it. Busy endpoints (work requests in flight) are never evicted: they count as
visited.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Node(Generic[K, V]):
    __slots__ = ("key", "value", "visited", "prev", "next")

    def __init__(self, key: K, value: V) -> None:
        self.key = key
        self.value = value
        self.visited = False
        self.prev: _Node[K, V] | None = None  # towards the head (newer)
        self.next: _Node[K, V] | None = None  # towards the tail (older)


class SievePool(Generic[K, V]):
    """A capped map with SIEVE eviction.

    ``busy(value)`` says whether an entry may not be evicted now; ``on_evict(key, value)`` is
    called for each evicted entry (outside no lock: the caller serializes access).
    """

    def __init__(
        self, capacity: int, on_evict: Callable[[K, V], None], busy: Callable[[V], bool] | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.on_evict = on_evict
        self.busy = busy or (lambda v: False)
        self._map: dict[K, _Node[K, V]] = {}
        self._head: _Node[K, V] | None = None
        self._tail: _Node[K, V] | None = None
        self._hand: _Node[K, V] | None = None
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def keys(self) -> list[K]:
        return list(self._map)

    def values(self) -> list[V]:
        return [n.value for n in self._map.values()]

    def get(self, key: K) -> V | None:
        """The value, marking it visited (a hit)."""
        node = self._map.get(key)
        if node is None:
            return None
        node.visited = True
        return node.value

    def put(self, key: K, value: V) -> None:
        """Insert a new entry at the head, evicting first when full."""
        if key in self._map:
            self._map[key].value = value
            self._map[key].visited = True
            return
        while len(self._map) >= self.capacity:
            if not self._evict_one():
                break  # everything busy: go over the cap rather than fail a transfer
        node = _Node(key, value)
        node.next = self._head
        if self._head is not None:
            self._head.prev = node
        self._head = node
        if self._tail is None:
            self._tail = node
        self._map[key] = node

    def pop(self, key: K) -> V | None:
        """Remove an entry without calling ``on_evict`` (e.g. it broke)."""
        node = self._map.pop(key, None)
        if node is None:
            return None
        self._unlink(node)
        return node.value

    def _unlink(self, node: _Node[K, V]) -> None:
        if self._hand is node:
            self._hand = node.prev
        if node.prev is not None:
            node.prev.next = node.next
        else:
            self._head = node.next
        if node.next is not None:
            node.next.prev = node.prev
        else:
            self._tail = node.prev
        node.prev = node.next = None

    def _evict_one(self) -> bool:
        # the hand moves from the tail (oldest) towards the head, clearing visited bits
        for _ in range(2 * len(self._map) + 1):
            node = self._hand or self._tail
            if node is None:
                return False
            if node.visited or self.busy(node.value):
                node.visited = False
                self._hand = node.prev
                continue
            self._hand = node.prev
            self._map.pop(node.key, None)
            self._unlink(node)
            self.evictions += 1
            self.on_evict(node.key, node.value)
            return True
        return False
