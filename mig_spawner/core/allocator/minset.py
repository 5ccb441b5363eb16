"""A set that answers its least member cheaply, for the allocator's index."""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

T = TypeVar("T")


class MinSet(Generic[T]):
    """Members, and the least of them in O(log n) amortised (a heap whose removed
    members are dropped when they reach the top)."""

    __slots__ = ("_heap", "_members")

    def __init__(self) -> None:
        self._heap: list[T] = []
        self._members: set[T] = set()

    def __len__(self) -> int:
        return len(self._members)

    def add(self, item: T) -> None:
        if item not in self._members:
            self._members.add(item)
            heapq.heappush(self._heap, item)

    def discard(self, item: T) -> None:
        self._members.discard(item)
        # Removed members stay in the heap until they reach its top; rebuild it when
        # they outnumber the members, so that it never grows past twice the set.
        if len(self._heap) > 2 * len(self._members) + 8:
            self._heap = list(self._members)
            heapq.heapify(self._heap)

    def least(self) -> T:
        """The least member (``IndexError`` when empty)."""
        heap, members = self._heap, self._members
        while heap[0] not in members:
            heapq.heappop(heap)
        return heap[0]
