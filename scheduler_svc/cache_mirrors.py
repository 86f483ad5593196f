"""The scheduler's mirrors of the ranks' caches (the counterpart of vLLM's encoder-cache manager): a byte- or
row-budgeted LRU whose entries leave only when the scheduler says so, pinned while a step or an unfinished item
needs them, so the scheduler knows exactly what each rank holds (docs/ARCHITECTURE.md §6). TransferPlanner
(transfer.py) keeps one per rank for payloads and one for the group's encoder outputs.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from common.errors import MmcastError
from common.ids import ItemId


class BudgetedLRU:
    """Sizes of the entries a cache holds under a budget, with pin counts and LRU order among unpinned ones."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._size: dict[ItemId, int] = {}
        self._pins: collections.Counter[ItemId] = collections.Counter()
        self._unpinned: collections.OrderedDict[ItemId, None] = collections.OrderedDict()  # LRU first
        self.used = 0
        self.evictable = 0  # sum of unpinned sizes

    def __contains__(self, key: ItemId) -> bool:
        return key in self._size

    def __len__(self) -> int:
        return len(self._size)

    def keys(self) -> list[ItemId]:
        return list(self._size)

    def can_fit(self, extra: int, keep: Iterable[ItemId] = ()) -> bool:
        """Whether ``extra`` more fits after evicting unpinned entries other than ``keep``."""
        kept = sum(self._size[k] for k in set(keep) if k in self._unpinned)
        return extra <= self.budget - self.used + self.evictable - kept

    def add(self, key: ItemId, size: int) -> list[ItemId]:
        """Inserts ``key`` pinned once, evicting LRU unpinned entries as needed; returns the evicted keys."""
        evicted = []
        while self.used + size > self.budget and self._unpinned:
            victim, _ = self._unpinned.popitem(last=False)
            self._drop(victim)
            evicted.append(victim)
        if self.used + size > self.budget:
            raise MmcastError(f"internal: cache mirror cannot fit {key[:16]} ({size} > free {self.budget - self.used})")
        self._size[key] = size
        self.used += size
        self._pins[key] = 1
        return evicted

    def _drop(self, key: ItemId) -> None:
        size = self._size.pop(key)
        self.used -= size
        self.evictable -= size
        del self._pins[key]

    def pin(self, key: ItemId) -> None:
        if self._pins[key] == 0:
            self._unpinned.pop(key)
            self.evictable -= self._size[key]
        self._pins[key] += 1

    def unpin(self, key: ItemId) -> None:
        self._pins[key] -= 1
        if self._pins[key] == 0:
            self._unpinned[key] = None  # most recently used
            self.evictable += self._size[key]

    def discard(self, key: ItemId) -> None:
        """Removes an unpinned entry without an eviction (the cache never held it)."""
        self._unpinned.pop(key)
        self._drop(key)

    def evict_unpinned(self) -> list[ItemId]:
        """Drops every unpinned entry (oldest first)."""
        out = list(self._unpinned)
        self._unpinned.clear()
        for key in out:
            self._drop(key)
        return out

    def pinned(self, key: ItemId) -> int:
        return self._pins.get(key, 0)

