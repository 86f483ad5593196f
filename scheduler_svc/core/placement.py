"""Owner placement (``--encoder-placement``, docs/ARCHITECTURE.md §2.4): which ranks receive an item's payload.

``sharded`` gives each item to one owner rank: one whose payload mirror already holds it (nothing travels), else
the rank with the fewest encoder rows given in the step that can take the payload beside everything else the
admission or window sends and keeps. ``replicated`` sends every payload to every rank, so each rank must have room.

These functions only judge and record a tentative admission or window (``Tentative``); the transfer decisions
(transfer.py) commit what they chose. The mirrors are ``cache_mirrors.BudgetedLRU``, one per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from common.errors import MmcastError
from common.ids import ItemId
from common.multimodal import MultiModalFeatureSpec
from scheduler_svc.core.cache_mirrors import BudgetedLRU
from scheduler_svc.core.step_plan import payload_nbytes


@dataclasses.dataclass
class Tentative:
    """What a tentative admission or window would do to each rank's payload mirror, before anything is committed."""

    extra: list[int]  # per rank: payload bytes the additions would take (bytes)
    keep: list[list[ItemId]]  # per rank: held payloads it relies on, which the additions must not evict (ids)
    load: list[int]  # per rank: encoder rows given in the step, this admission or window included (rows)

    @classmethod
    def empty(cls, load: Sequence[int]) -> Tentative:
        """Nothing added yet, on top of the step's encoder rows per rank so far."""
        return cls([0] * len(load), [[] for _ in load], list(load))


def least_loaded(ranks: Iterable[int], load: Sequence[int]) -> int | None:
    """The rank with the fewest encoder rows (the lowest index on a tie), or None when there is none."""
    return min(ranks, key=lambda r: (load[r], r), default=None)


def choose_owner(mirrors: Sequence[BudgetedLRU], t: Tentative, key: ItemId, nbytes: int, rows: int) -> int | None:
    """sharded: the owner of one item — a rank holding its payload, else the least loaded rank with room for it —
    recorded in ``t``; None when no rank can take it."""
    rank = least_loaded(
        (r for r, m in enumerate(mirrors) if key in m and m.can_fit(t.extra[r], [*t.keep[r], key])), t.load
    )
    if rank is not None:
        t.keep[rank].append(key)
    else:
        rank = least_loaded(
            (r for r, m in enumerate(mirrors) if key not in m and m.can_fit(t.extra[r] + nbytes, t.keep[r])), t.load
        )
        if rank is None:
            return None  # no rank has room for the payload beside what the admission or window already uses
        t.extra[rank] += nbytes
    t.load[rank] += rows
    return rank


def fits_every_rank(mirrors: Sequence[BudgetedLRU], t: Tentative, key: ItemId, nbytes: int) -> bool:
    """replicated: whether every rank can hold the item's payload (held, or room for it); recorded in ``t`` when so."""
    for rank, mirror in enumerate(mirrors):
        fits = (
            mirror.can_fit(t.extra[rank], [*t.keep[rank], key])
            if key in mirror
            else mirror.can_fit(t.extra[rank] + nbytes, t.keep[rank])
        )
        if not fits:
            return False  # one rank without room is enough: every rank must hold it
    for rank, mirror in enumerate(mirrors):
        if key in mirror:
            t.keep[rank].append(key)
        else:
            t.extra[rank] += nbytes
    return True


def admission_owners(
    mirrors: Sequence[BudgetedLRU], sends: Sequence[MultiModalFeatureSpec], load: Sequence[int]
) -> dict[ItemId, int] | None:
    """sharded full/strip: an owner for every item an admission sends, or None when some item fits no rank."""
    t = Tentative.empty(load)
    owners: dict[ItemId, int] = {}
    for f in sends:
        if f.identifier in owners:
            continue  # the same image again in the prompt: one owner, one payload
        rank = choose_owner(mirrors, t, f.identifier, payload_nbytes(f), f.mm_position.get_num_embeds())
        if rank is None:
            return None  # one item without a rank is enough: the admission waits for room
        owners[f.identifier] = rank
    return owners


def admission_fits_every_rank(mirrors: Sequence[BudgetedLRU], sends: Sequence[MultiModalFeatureSpec]) -> bool:
    """replicated full/strip: whether every rank can take every payload an admission sends at once."""
    for mirror in mirrors:
        new = {f.identifier: payload_nbytes(f) for f in sends if f.identifier not in mirror}
        held = [f.identifier for f in sends if f.identifier in mirror]
        if not mirror.can_fit(sum(new.values()), held):
            return False  # this rank cannot take them all, and every rank receives every payload
    return True


def owner_holding(mirrors: Sequence[BudgetedLRU], key: ItemId) -> int:
    """sharded full/strip: the rank whose mirror pins the item's payload (its owner, from admission on)."""
    for rank, mirror in enumerate(mirrors):
        if mirror.pinned(key):
            return rank
    raise MmcastError(
        f"internal: no rank holds the payload of item {key[:16]} (sharded full/strip pins it on its owner at admission)"
    )
