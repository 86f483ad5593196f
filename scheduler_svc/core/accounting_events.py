"""The delivery events the transfer decisions emit and the tallies they fold into: ``ItemAccounting`` (one
request's events in one step, or a step's totals) and ``RequestUsage`` (a request's cumulative counts, the public
``Usage``). The rules that decide the events are ``accounting.py``'s (its module doc; docs/ARCHITECTURE.md §2.4).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

from common.ids import ItemId, RequestId


class Disposition(enum.Enum):
    """What became of one item's delivery to one rank; the value is its ``mmcast_mm_items_total`` label."""

    SENT = "sent"  # the payload was written to the rank
    PREFIX_COVERED = "stripped"  # no request admitted in the step needed it: its tokens were in the prefix cache
    RANK_CACHED = "rank_cached"  # lazy: the rank held the payload, or the group the item's encoder output
    ENCODER_SHARED = "encoder_shared"  # sharded: the owner's encoder output reached the rank instead
    ABANDONED = "abandoned"  # lazy: every request holding the due ended before reaching the item


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One event: an item's delivery to one rank, and what became of it."""

    request_id: RequestId  # the request charged with it
    item: ItemId  # the item's identifier
    rank: int  # the rank it was (sent) or would have been (the others) written to
    disposition: Disposition  # sent, or why it was not
    nbytes: int  # payload tensor bytes written (sent) or not written (the others), frame overhead excluded


@dataclasses.dataclass(frozen=True)
class EncoderRun:
    """One event: an item's encoder work scheduled over the group for a request."""

    request_id: RequestId  # the request whose window encodes the item
    item: ItemId  # the item's identifier
    runs: int  # vision-encoder runs: 1 under sharded placement (the owner), one per rank under replicated
    output_bytes_shared: int  # encoder-output bytes the owner broadcasts, summed over the receiving ranks (bytes)


class _Names(NamedTuple):
    """Where one disposition is counted: the one table that names every accounting field (below)."""

    count: str  # ItemAccounting field of its deliveries
    nbytes: str | None  # ItemAccounting field of their payload bytes (None: no bytes are counted)
    usage_count: str  # RequestUsage field of its deliveries (the proto Usage's names are servicer.py's)
    usage_bytes: str | None  # RequestUsage field of their bytes (None: none)
    saved_reason: str | None  # reason label of mmcast_broadcast_payload_bytes_saved_total (None: not a saving)


_FIELDS: dict[Disposition, _Names] = {
    Disposition.SENT: _Names("sent", "payload_bytes_sent", "items_sent", "payload_bytes_sent", None),
    Disposition.PREFIX_COVERED: _Names(
        "stripped",
        "bytes_saved_prefix_covered",
        "items_stripped",
        "payload_bytes_saved_prefix_covered",
        "prefix_covered",
    ),
    Disposition.RANK_CACHED: _Names(
        "rank_cached", "bytes_saved_rank_cached", "items_rank_cached", "payload_bytes_saved_rank_cached", "rank_cached"
    ),
    Disposition.ENCODER_SHARED: _Names(
        "encoder_shared",
        "bytes_saved_encoder_shared",
        "items_encoder_shared",
        "payload_bytes_saved_encoder_shared",
        "encoder_shared",
    ),
    Disposition.ABANDONED: _Names("abandoned", None, "items_abandoned", None, None),
}
_ENCODER_FIELDS = ("encoder_runs", "encoder_output_bytes_shared")  # the same name in the tally and the Usage


@dataclasses.dataclass
class RequestUsage:
    """Cumulative per-request accounting (the service's ``Usage``); item counts are summed over ranks."""

    cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission (tokens)
    items_sent: int = 0  # item deliveries with payload (deliveries)
    items_stripped: int = 0  # item deliveries whose payload was prefix-covered (deliveries)
    items_rank_cached: int = 0  # item deliveries the ranks already held, payload or encoder output (deliveries)
    items_abandoned: int = 0  # deferred item deliveries never needed: the request left before them (deliveries)
    payload_bytes_sent: int = 0  # payload tensor bytes selected for the ranks for this request (bytes)
    payload_bytes_saved_prefix_covered: int = 0  # bytes `full` would have sent for covered items (bytes)
    payload_bytes_saved_rank_cached: int = 0  # bytes `full` would have sent for items the ranks held (bytes)
    items_encoder_shared: int = 0  # sharded: deliveries replaced by the owner's output on the collective (deliveries)
    payload_bytes_saved_encoder_shared: int = 0  # bytes `full` would have sent for those (bytes)
    encoder_runs: int = 0  # vision-encoder runs over the group for the request's items (runs)
    encoder_output_bytes_shared: int = 0  # encoder-output bytes broadcast on the collective, over receivers (bytes)
    preemptions: int = 0  # times preempted (or requeued by a recovery) and resumed (times)

    @property
    def payload_bytes_saved(self) -> int:
        """Payload bytes `full` would have sent in addition, every reason together (the public Usage's)."""
        return sum(getattr(self, n.usage_bytes) for n in _FIELDS.values() if n.usage_bytes and n.saved_reason)


@dataclasses.dataclass
class ItemAccounting:
    """A tally of delivery events: one request's in one step (``StepPlan.accounting``), or a step's totals
    (``StepPlan.totals``). Item counts are summed over ranks (one per item per rank)."""

    sent: int = 0  # deliveries whose payload travels, at admission (full/strip) or when encoded (lazy) (deliveries)
    stripped: int = 0  # deliveries whose payload was prefix-covered at admission (deliveries)
    rank_cached: int = 0  # lazy: deliveries the rank already held, payload or encoder output (deliveries)
    abandoned: int = 0  # lazy: deliveries due that no request reached; every holder ended first (deliveries)
    payload_bytes_sent: int = 0  # payload tensor bytes written to the ranks, frame overhead excluded (bytes)
    bytes_saved_prefix_covered: int = 0  # payload bytes full would have sent for stripped deliveries (bytes)
    bytes_saved_rank_cached: int = 0  # payload bytes full would have sent for rank_cached deliveries (bytes)
    encoder_shared: int = 0  # sharded: deliveries the owner's encoder output replaced (deliveries)
    bytes_saved_encoder_shared: int = 0  # payload bytes full would have sent for encoder_shared deliveries (bytes)
    encoder_runs: int = 0  # vision-encoder runs over the group: sharded 1 per item encoded, replicated ranks (runs)
    encoder_output_bytes_shared: int = 0  # sharded: encoder-output bytes broadcast, summed over receivers (bytes)

    def fold(self, event: Delivery | EncoderRun) -> None:
        if isinstance(event, EncoderRun):
            self.encoder_runs += event.runs
            self.encoder_output_bytes_shared += event.output_bytes_shared
            return  # encoder work, not a delivery
        names = _FIELDS[event.disposition]
        setattr(self, names.count, getattr(self, names.count) + 1)
        if names.nbytes is not None:
            setattr(self, names.nbytes, getattr(self, names.nbytes) + event.nbytes)

    def add(self, other: ItemAccounting) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @classmethod
    def total(cls, tallies: list[ItemAccounting]) -> ItemAccounting:
        out = cls()
        for acc in tallies:
            out.add(acc)
        return out

    def add_to_usage(self, usage: RequestUsage) -> None:
        for n in _FIELDS.values():
            for mine, theirs in ((n.count, n.usage_count), (n.nbytes, n.usage_bytes)):
                if mine is not None and theirs is not None:
                    setattr(usage, theirs, getattr(usage, theirs) + getattr(self, mine))
        for name in _ENCODER_FIELDS:
            setattr(usage, name, getattr(usage, name) + getattr(self, name))

    def by_disposition(self) -> list[tuple[Disposition, int, int, str | None]]:
        """(disposition, deliveries, bytes, saved-bytes reason label or None) for the metrics."""
        return [
            (d, getattr(self, n.count), getattr(self, n.nbytes) if n.nbytes else 0, n.saved_reason)
            for d, n in _FIELDS.items()
        ]
