"""The scheduler's mirrors of the ranks' caches (the counterpart of vLLM's encoder-cache manager): a byte- or
row-budgeted LRU whose entries leave only when the scheduler says so, pinned while a step or an unfinished item
needs them, so the scheduler knows exactly what each rank holds (docs/ARCHITECTURE.md §6). ``GroupMirrors`` holds
one per rank for payloads (bytes) and one for the group's encoder outputs (rows: every rank ends a step with the
same outputs), with what the step in flight pins and evicts; the transfer decider (transfer.py) keeps one.

Only unpinned entries are evicted, least recently used first, always by an explicit id in a step's control. What
the decider pins:
- encoder output: every request item from the step that encodes or reuses it until the request has computed past
  the item's end (a partially computed item keeps its output);
- payload, full/strip: every uncovered item from admission until computed past it; unpinned payloads are evicted
  at the next step (nothing would ever reuse them: these modes resend at every admission);
- payload, lazy: only during the step that encodes it, then kept (LRU) for reuse.
Everything sent in a step is pinned for that step, so a step never evicts what it sends or uses.
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


class GroupMirrors:
    """Every rank's payload mirror and the group's encoder mirror, with the step's pins and evictions."""

    def __init__(self, num_ranks: int, payload_cache_bytes: int, encoder_cache_tokens: int) -> None:
        self.payloads = [BudgetedLRU(payload_cache_bytes) for _ in range(num_ranks)]  # per rank (bytes)
        self.encoder = BudgetedLRU(encoder_cache_tokens)  # the group's encoder outputs (rows)
        self.begin_step()

    def begin_step(self) -> None:
        self._step_pins: list[tuple[int, ItemId]] = []  # (rank, id) payload pins held for this step only
        self._evicted: list[set[ItemId]] = [set() for _ in self.payloads]  # per rank: payloads evicted this step
        self._evicted_encoder: set[ItemId] = set()  # encoder outputs evicted this step
        self.evict_payload_ids: dict[ItemId, None] = {}  # the step's payload evictions, in order (every rank)
        self.evict_encoder_ids: list[ItemId] = []  # the step's encoder-output evictions, in order

    def reset(self) -> None:
        """The ranks lost every cache (recovery): empty mirrors, no step in flight."""
        self.payloads = [BudgetedLRU(m.budget) for m in self.payloads]
        self.encoder = BudgetedLRU(self.encoder.budget)
        self.begin_step()

    def forget_encoder(self, key: ItemId) -> None:
        """Drops an encoder-mirror entry the ranks never stored (its encoding failed), once nothing pins it."""
        if key in self.encoder and not self.encoder.pinned(key):
            self.encoder.discard(key)

    def usable(self, key: ItemId) -> bool:
        """An id evicted earlier in this step may not be sent or used again in it: the control would carry the id
        both ways, and the ranks apply evictions after receiving the step's payloads."""
        return key not in self._evicted_encoder and not any(key in ev for ev in self._evicted)

    def send_payload(self, rank: int, key: ItemId, nbytes: int) -> None:
        """The rank gets the payload this step: pinned until ``end_step``, added when it is new (what that displaces
        is evicted in the control)."""
        mirror = self.payloads[rank]
        if key in mirror:
            mirror.pin(key)  # full/strip resend what the rank holds; or a second item with this id this step
        else:
            for victim in mirror.add(key, nbytes):
                self._note_payload_eviction(rank, victim)
        self._step_pins.append((rank, key))

    def add_encoder(self, key: ItemId, rows: int) -> None:
        """The group encodes the item this step (pinned once); what it displaces is evicted in the control."""
        for victim in self.encoder.add(key, rows):
            self.evict_encoder_ids.append(victim)
            self._evicted_encoder.add(victim)

    def pin_for_step(self, rank: int, key: ItemId) -> None:
        """Pins a payload the rank holds until ``end_step``."""
        self.payloads[rank].pin(key)
        self._step_pins.append((rank, key))

    def evict_unpinned_payloads(self) -> None:
        for rank, mirror in enumerate(self.payloads):
            for key in mirror.evict_unpinned():
                self._note_payload_eviction(rank, key)

    def end_step(self) -> None:
        """Releases this step's payload pins (the step ran; its payloads were consumed)."""
        for rank, key in self._step_pins:
            self.payloads[rank].unpin(key)
        self._step_pins = []

    def _note_payload_eviction(self, rank: int, key: ItemId) -> None:
        self.evict_payload_ids[key] = None
        self._evicted[rank].add(key)
