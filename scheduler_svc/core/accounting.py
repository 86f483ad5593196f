"""Transfer accounting, in one place: the delivery events the transfer decisions emit (transfer.py), the
deliveries ``full`` would have made (*dues*), and the one fold of both into each request's ``RequestUsage`` (the
public ``Usage``, servicer.py) and each step's totals (the metrics, ``engine._count_plan``). The events and the
tallies they fold into are ``accounting_events.py``'s, which ``request.py`` can import without this module.

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
from collections.abc import Callable, Sequence

from common.ids import ItemId, RequestId
from common.multimodal import Modality
from scheduler_svc.core.accounting_events import Delivery, Disposition, EncoderRun, ItemAccounting, RequestUsage
from scheduler_svc.core.request import Request


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
