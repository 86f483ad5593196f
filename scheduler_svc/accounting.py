"""Transfer accounting, in one place: the delivery events the transfer decisions emit (transfer.py), the
deliveries ``full`` would have made (*dues*), and the one fold of both into each request's ``RequestUsage`` (the
public ``Usage``, servicer.py) and each step's totals (the metrics, ``engine._count_plan``).

Two rules make the counts equal to what travelled (docs/ARCHITECTURE.md §2.4):
- a delivery is one payload written to one rank in one step: ``sent`` / ``payload_bytes_sent`` count it once, for
  the request whose admission or encoder work first needed it in that step, however many occurrences (the same
  image twice in a prompt) or requests (one image in two requests admitted together) needed it. The sums
  therefore equal the payload frames the group writes (``mmcast_broadcast_bytes_total{kind="payload"}``, which
  adds the frame headers) and the ranks receive.
- "saved" compares with ``full``, which at each step writes every item of the requests admitted in that step
  once per rank. Each such (step, item) is one *due*, settled exactly once per rank: written (``sent``), replaced
  by the owner's encoder output on the collective (sharded: ``encoder_shared``, every rank but the owner),
  prefix-covered (no admitted request of the step needed its payload: ``stripped``, charged to the first admitted
  request that had it), rank-cached (lazy: a rank already held the payload, or the group its encoder output, when
  the first request holding the due reached the item: ``rank_cached``), or abandoned (lazy: every request holding
  it ended before reaching it). A request preempted before reaching a deferred item drops its share of the due
  without a count: its resumption is a new admission with dues of its own.
A payload written again after an eviction (lazy's re-sends) is sent without a due: the wire carried it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from common.ids import ItemId, RequestId
from common.multimodal import Modality

if TYPE_CHECKING:  # request.py imports RequestUsage from here
    from scheduler_svc.request import Request


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


@dataclasses.dataclass
class _Due:
    """A delivery ``full`` would have made at one admission step: one item to every rank (see the module doc)."""

    nbytes: int  # payload bytes per rank (bytes)
    first: RequestId  # the first request admitted in the step that has the item (charged if it is prefix-covered)
    needed: bool = False  # some request admitted in the step needs the payload (an uncovered occurrence; full: all)
    holders: int = 0  # lazy: requests admitted in the step that may still settle it by reaching the item (requests)
    open: bool = True  # lazy: not settled yet


class TransferAccounting:
    """The dues of every admission and the fold of the delivery events; the transfer decider owns one."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._dues: dict[RequestId, dict[ItemId, _Due]] = {}  # lazy dues each request holds, by item
        self.released = ItemAccounting()  # abandoned by requests that ended since the last plan (for the metrics)
        # The video items of requests still held, so the metrics can say which deliveries were videos: the
        # requests holding each, and the video share of the events since the last plan (``take_video``).
        self._videos_of: dict[RequestId, set[ItemId]] = {}
        self._video_refs: dict[ItemId, int] = {}
        self.video = ItemAccounting()
        self.begin_step()

    def begin_step(self) -> None:
        self.step: dict[RequestId, ItemAccounting] = {}  # per request: this step's events, folded
        self._step_dues: dict[ItemId, _Due] = {}  # dues of this step's admissions, by item
        self._shared: set[ItemId] = set()  # sharded full/strip: items whose dues are already settled as shared

    def reset(self) -> None:
        """Recovery: every running request comes back as a new admission, with dues of its own."""
        self._dues.clear()
        self.begin_step()

    def opened(self, request_id: RequestId) -> ItemAccounting:
        """The request's tally of this step (present in the plan even when nothing is counted)."""
        acc = self.step.get(request_id)
        if acc is None:
            acc = self.step[request_id] = ItemAccounting()
        return acc

    def record(self, event: Delivery | EncoderRun) -> None:
        self.opened(event.request_id).fold(event)
        if event.item in self._video_refs:
            self.video.fold(event)

    def record_ranks(
        self, request_id: RequestId, key: ItemId, disposition: Disposition, nbytes: int, but: int | None = None
    ) -> None:
        """One event per rank of the group, but the rank ``but`` (sharded: the owner) when it is given."""
        for rank in range(self.num_ranks):
            if rank != but:
                self.record(Delivery(request_id, key, rank, disposition, nbytes))

    def admitted(self, request: Request, sizes: Sequence[int], full: bool, lazy: bool) -> None:
        """Registers the request's items in this step's dues (one per item, whatever the occurrences or requests);
        a lazy request holds the dues of the items it still has to reach. ``sizes``: each item's payload bytes."""
        held = self._dues.setdefault(request.request_id, {})
        videos = self._videos_of.setdefault(request.request_id, set())
        for k, f in enumerate(request.mm_features):
            key = f.identifier
            if f.modality is Modality.VIDEO and key not in videos:
                videos.add(key)
                self._video_refs[key] = self._video_refs.get(key, 0) + 1
            due = self._step_dues.get(key)
            if due is None:
                due = self._step_dues[key] = _Due(sizes[k], request.request_id)
            if full or k >= request.item_cursor:
                due.needed = True
                if lazy and key not in held:
                    held[key] = due
                    due.holders += 1

    def settle(self, request_id: RequestId, key: ItemId) -> int | None:
        """Settles the open due the request holds for ``key`` (the caller records how); its payload bytes per rank,
        or None when it holds none (not lazy, settled already, or a re-send)."""
        due = self._dues.get(request_id, {}).get(key)
        if due is None or not due.open:
            return None  # nothing left to settle: another request or an earlier step did, or none was due
        due.open = False
        return due.nbytes

    def first_share(self, key: ItemId) -> bool:
        """sharded full/strip: True the first time in the step (the item's dues settle as shared once per step)."""
        if key in self._shared:
            return False  # settled already in this step (a repeat, or another admission of the same item)
        self._shared.add(key)
        return True

    def finish_step(self) -> None:
        """Settles this step's dues that no admitted request needed: prefix-covered on every rank."""
        for key, due in self._step_dues.items():
            if not due.needed:
                self.record_ranks(due.first, key, Disposition.PREFIX_COVERED, due.nbytes)

    def take_step(
        self, usage_of: Callable[[RequestId], RequestUsage]
    ) -> tuple[dict[RequestId, ItemAccounting], ItemAccounting]:
        """Adds the step's tallies to each request's Usage; returns them (the plan's ``accounting``) and what ended
        requests left since the last plan (``released``: already in their Usage, only the metrics add it)."""
        for rid, acc in self.step.items():
            acc.add_to_usage(usage_of(rid))
        released, self.released = self.released, ItemAccounting()
        return self.step, released

    def take_video(self) -> ItemAccounting:
        """The video items' share of the events since the last call (this step's and what ended requests left):
        the metrics' ``modality="video"`` series; the rest of ``StepPlan.totals`` is images."""
        video, self.video = self.video, ItemAccounting()
        return video

    def release(self, request: Request, ended: bool) -> None:
        """The request holds no due any more; an ended one abandons (on every rank) each lazy due it held last, in
        its Usage at once and in ``released`` for the metrics. A preempted one comes back with dues of its own."""
        abandoned = ItemAccounting()
        for key, due in self._dues.pop(request.request_id, {}).items():
            due.holders -= 1
            if due.open and due.holders == 0:
                due.open = False
                if ended:
                    for rank in range(self.num_ranks):
                        event = Delivery(request.request_id, key, rank, Disposition.ABANDONED, due.nbytes)
                        abandoned.fold(event)
                        if key in self._video_refs:
                            self.video.fold(event)
        abandoned.add_to_usage(request.usage)
        self.released.add(abandoned)
        for key in self._videos_of.pop(request.request_id, ()):
            self._video_refs[key] -= 1
            if not self._video_refs[key]:
                del self._video_refs[key]
