"""Transfer decisions: which item payloads go to which rank in which step (docs/ARCHITECTURE.md §2.4).

Modes (``--transfer-mode``):
- ``full``: at admission every item is PRESENT and its payload goes to every rank (the baseline).
- ``strip``: at admission items with ``end <= num_computed_tokens`` are STRIPPED (``strip_covered_mm_data``,
  keep_on_cpu fields kept for M-RoPE models); the others are PRESENT and travel at admission.
- ``lazy``: at admission covered items are STRIPPED and the others DEFERRED (metadata only); a payload travels in
  the step that schedules the item's encoder work, and only to ranks whose mirror lacks it.
Which ranks receive a payload is placement.py's (``--encoder-placement``): every rank (``replicated``), or the
item's one owner (``sharded``; full/strip at admission, lazy in the step that encodes it). A re-encode (after an
eviction or a preemption) goes to a rank still holding the payload, or the payload travels again. Every decision
emits delivery events (``accounting.Delivery``, ``accounting.EncoderRun``); accounting.py alone counts them.

Mirrors and what pins them: cache_mirrors.py (docs/ARCHITECTURE.md §6). Per-request cursors keep the work bounded: items
``[item_cursor, pin_end)`` are the request's pinned (started, unfinished) items; a window (windows.py) only looks
at items from ``item_cursor`` while they start before the window's end.

Strip's guarantee. ``strip`` sends every uncovered payload at admission, so a request whose uncovered payloads
exceed a rank's payload cache could never be admitted. Such a request (a first admission that misses, or a
preempted or requeued one that lost its prefix) has its uncovered items DEFERRED instead, each sent in the step
that encodes it, as ``lazy`` does (``_deferring``); "cached X + new Y" is served when Y fits. So every request that
fits the per-item limits is eventually admitted.
"""

from __future__ import annotations

import bisect
import dataclasses

from common.errors import MmcastError
from common.ids import ItemId, RequestId
from common.multimodal import MultiModalFeatureSpec, PayloadState, strip_covered_mm_data
from scheduler_svc.config import ENCODER_PLACEMENTS, TRANSFER_MODES
from scheduler_svc.core import placement, windows
from scheduler_svc.core.accounting import TransferAccounting
from scheduler_svc.core.accounting_events import Delivery, Disposition, EncoderRun
from scheduler_svc.core.cache_mirrors import GroupMirrors
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_plan import PayloadSend, payload_nbytes
from scheduler_svc.core.windows import Window


class TransferDecider:
    """Mirrors plus the per-step decisions; the scheduler calls it in a fixed order per step (see scheduler.py)."""

    def __init__(
        self,
        mode: str,
        uses_mrope: bool,
        num_ranks: int,
        payload_cache_bytes: int,
        encoder_cache_tokens: int,
        placement: str = "replicated",
        encoder_row_bytes: int = 0,
        step_encoder_tokens: int = 0,
    ) -> None:
        if mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode={mode!r}; choose one of {TRANSFER_MODES}")
        if placement not in ENCODER_PLACEMENTS:
            raise ValueError(f"encoder_placement={placement!r}; choose one of {ENCODER_PLACEMENTS}")
        self.mode = mode
        self.sharded = placement == "sharded"
        self.encoder_row_bytes = encoder_row_bytes  # bytes of one encoder-output row, the handshake's (bytes)
        self.uses_mrope = uses_mrope
        self.num_ranks = num_ranks
        self.encoder_cache_tokens = encoder_cache_tokens
        # encoder rows one step may encode (0: no limit but the cache); a step's first item is exempt
        self.step_encoder_tokens = step_encoder_tokens
        self.mirrors = GroupMirrors(num_ranks, payload_cache_bytes, encoder_cache_tokens)
        self.book = TransferAccounting(num_ranks)  # the dues and the fold of this decider's delivery events
        self._deferring: set[RequestId] = set()  # strip requests admitted with deferred payloads (too big)
        self._candidate: RequestId | None = None  # the request place_cursor prepared for admission
        self._candidate_defers = False  # whether that strip request's payloads would be deferred
        self.begin_step()

    # --- step lifecycle ----------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.book.begin_step()
        self.mirrors.begin_step()
        self.rank_payloads: list[list[PayloadSend]] = [[] for _ in range(self.num_ranks)]  # per rank, in order
        self._sent: list[set[ItemId]] = [set() for _ in range(self.num_ranks)]  # per rank: ids queued this step
        self.encoder_inputs: list[ItemId] = []
        self.encoder_owners: list[int | None] = []  # per encoder input: its owner (sharded) or None (every rank)
        self.encoder_tokens = 0  # encoder rows scheduled this step
        self._load = [0] * self.num_ranks  # sharded: encoder rows given to each rank this step (admission + windows)
        self._admission_owners: dict[ItemId, int] = {}  # sharded full/strip: owners chosen by admission_fits
        self.items_examined = 0

    def finish_step(self) -> None:
        """Settles this step's prefix-covered dues; full/strip: evicts every payload nothing needs any more (these
        modes never reuse one); what this step sends or uses is pinned, so it stays."""
        self.book.finish_step()
        if self.mode != "lazy":
            self.mirrors.evict_unpinned_payloads()

    def _lazy(self, request: Request) -> bool:
        """Whether the request's payloads travel with its encoder work (lazy mode, or a too-big strip request)."""
        rid = request.request_id
        return self.mode == "lazy" or rid in self._deferring or (rid == self._candidate and self._candidate_defers)

    # --- admission ---------------------------------------------------------------------------------------------
    def place_cursor(self, request: Request, num_computed: int) -> None:
        """Points the request's cursors at its first item not covered by ``num_computed`` tokens."""
        ends = [f.mm_position.end for f in request.mm_features]
        request.item_cursor = request.pin_end = bisect.bisect_right(ends, num_computed)
        self._candidate_defers = False
        if self.mode == "strip":  # strip's guarantee (module doc): what cannot travel at once is deferred
            uncovered = {f.identifier: payload_nbytes(f) for f in request.mm_features[request.item_cursor :]}
            self._candidate_defers = sum(uncovered.values()) > min(m.budget for m in self.mirrors.payloads)
        self._candidate = request.request_id  # the admission being tried: plan_window, admission_fits, commit

    def _admission_sends(self, request: Request) -> list[MultiModalFeatureSpec]:
        """Items whose payload goes out at admission (full: all; strip: uncovered; lazy: none)."""
        if self.mode == "full":
            return request.mm_features
        if not self._lazy(request):
            return request.mm_features[request.item_cursor :]
        return []

    def admission_fits(self, request: Request) -> bool:
        """full/strip: whether every rank (sharded: each item's owner) can take the payloads this admission sends."""
        sends = self._admission_sends(request)
        if not sends:
            return True  # nothing travels at admission (lazy, deferred, or every item covered)
        if not all(self.mirrors.usable(f.identifier) for f in sends):
            return False  # an id evicted earlier in this step cannot travel in it: admit next step
        if self.sharded:
            owners = placement.admission_owners(self.mirrors.payloads, sends, self._load)
            self._admission_owners = owners or {}
            return owners is not None
        return placement.admission_fits_every_rank(self.mirrors.payloads, sends)

    def commit_admission(self, request: Request, num_computed: int) -> list[MultiModalFeatureSpec]:
        """Decides each item's wire state, queues full/strip payloads, pins them; returns the wire items."""
        features = request.mm_features
        self.items_examined += len(features)
        self.book.opened(request.request_id)
        lazy = self._lazy(request)
        if lazy and self.mode == "strip":
            self._deferring.add(request.request_id)
        self.book.admitted(request, [payload_nbytes(f) for f in features], self.mode == "full", lazy)
        if self.mode == "full":
            wire = list(features)
        else:
            wire = list(strip_covered_mm_data(features, num_computed, uses_mrope=self.uses_mrope) or [])
        if lazy:
            for i in range(request.item_cursor, len(wire)):
                wire[i] = dataclasses.replace(wire[i], payload_state=PayloadState.DEFERRED)
            return wire  # deferred: each payload travels with its encoder work (commit_window)
        sends = self._admission_sends(request)
        first = len(features) - len(sends)  # full sends from item 0, strip from the first uncovered item
        if not self.sharded:  # every rank gets every payload, one rank after the other
            self._send_at_admission(
                request, [(rank, k, f) for rank in range(self.num_ranks) for k, f in enumerate(sends, start=first)]
            )
            return wire
        owners = self._admission_owners  # each payload to its owner only, in the items' order
        self._send_at_admission(request, [(owners[f.identifier], k, f) for k, f in enumerate(sends, start=first)])
        for f in sends:
            if not self.book.first_share(f.identifier):
                continue  # a second occurrence, or admitted beside another request this step: settled once
            rank = owners[f.identifier]
            self._load[rank] += f.mm_position.get_num_embeds()
            self.book.record_ranks(
                request.request_id, f.identifier, Disposition.ENCODER_SHARED, payload_nbytes(f), but=rank
            )
        return wire

    def _send_at_admission(self, request: Request, sends: list[tuple[int, int, MultiModalFeatureSpec]]) -> None:
        """Sends each (rank, item index, item) and pins it there until the request computes past an uncovered item;
        what the ranks already hold is pinned first, so that adding the others cannot evict it."""
        held = [(rank, f.identifier) for rank, _, f in sends if f.identifier in self.mirrors.payloads[rank]]
        for rank, key in held:
            self.mirrors.payloads[rank].pin(key)
        for rank, k, f in sends:
            self._send(rank, f, request)
            if k >= request.item_cursor:
                self.mirrors.payloads[rank].pin(f.identifier)  # held until the request computes past the item
        for rank, key in held:
            self.mirrors.payloads[rank].unpin(key)

    def _send(self, rank: int, feature: MultiModalFeatureSpec, request: Request) -> None:
        """Queues the payload for a rank and pins it for the step; the first time in the step it is queued for
        that rank, emits the delivery for this request (what the wire carries: once per item, rank and step)."""
        key = feature.identifier
        self.mirrors.send_payload(rank, key, payload_nbytes(feature))
        if key not in self._sent[rank]:
            self._sent[rank].add(key)
            self.rank_payloads[rank].append(PayloadSend(key, feature, request.request_id))
            self.book.record(Delivery(request.request_id, key, rank, Disposition.SENT, payload_nbytes(feature)))

    # --- windows -----------------------------------------------------------------------------------------------
    def plan_window(self, request: Request, start: int, end: int) -> Window:
        """Cuts ``[start, end)`` before the first item whose encoder work cannot be scheduled; changes nothing."""
        room = self.encoder_cache_tokens - self.encoder_tokens
        compute = room if not self.step_encoder_tokens else self.step_encoder_tokens - self.encoder_tokens
        window = windows.plan_window(
            request,
            start,
            end,
            self.mirrors,
            min(room, compute),
            self._load,
            first_room=room if self.encoder_tokens == 0 else 0,
            lazy=self._lazy(request),
            sharded=self.sharded,
        )
        self.items_examined += window.examined
        return window

    def commit_window(self, request: Request, window: Window) -> None:
        """Pins encoder outputs, schedules encoder inputs and (lazy) payload sends; emits their deliveries.
        Everything already held is pinned before anything is added, so additions never evict it."""
        features, rid = request.mm_features, request.request_id
        self.book.opened(rid)
        lazy = self._lazy(request)
        encoder = self.mirrors.encoder
        later = [i for i in window.reuse if features[i].identifier not in encoder]  # encoded by this window
        for i in window.reuse:
            if features[i].identifier in encoder:
                encoder.pin(features[i].identifier)  # held: pinned before the window's encodes add anything
        owners: dict[int, int] = {}
        for i in window.encode:
            key = features[i].identifier
            due = self.book.settle(rid, key) if lazy else None  # settled per rank: held here, else sent below
            if self.sharded:
                owners[i] = self._commit_owner(request, i, window, due, lazy)
                continue  # one owner: its payload is handled there, the other ranks get its output
            for rank, mirror in enumerate(self.mirrors.payloads):
                if not lazy:
                    if mirror.pinned(key) == 0:
                        raise MmcastError(
                            f"internal: rank {rank} does not hold the payload of item {key[:16]} "
                            f"({self.mode} mode sends it at admission)"
                        )
                elif key in mirror:  # held since an earlier step (this step's sends come with encoding = reuse)
                    self.mirrors.pin_for_step(rank, key)
                    if due is not None:
                        self.book.record(Delivery(rid, key, rank, Disposition.RANK_CACHED, due))
        for i in window.encode:
            f = features[i]
            key = f.identifier
            tokens = f.mm_position.get_num_embeds()
            self.mirrors.add_encoder(key, tokens)
            self.encoder_inputs.append(key)
            self.encoder_owners.append(owners.get(i))
            self.encoder_tokens += tokens
            shared = (self.num_ranks - 1) * tokens * self.encoder_row_bytes if self.sharded else 0
            self.book.record(EncoderRun(rid, key, 1 if self.sharded else self.num_ranks, shared))
            if self.sharded:
                self._load[owners[i]] += tokens
            for rank in [owners[i]] if self.sharded else range(self.num_ranks):
                if lazy and key not in self._sent[rank] and key not in self.mirrors.payloads[rank]:
                    self._send(rank, f, request)
        for i in later:
            encoder.pin(features[i].identifier)
        for i in window.reuse if lazy else ():  # the ranks hold (or get this step) its output: no payload needed
            due = self.book.settle(rid, features[i].identifier)
            if due is not None:
                self.book.record_ranks(rid, features[i].identifier, Disposition.RANK_CACHED, due)
        reached = window.encode + window.reuse
        if reached:
            request.pin_end = max(request.pin_end, max(reached) + 1)

    def _commit_owner(self, request: Request, i: int, window: Window, due: int | None, lazy: bool) -> int:
        """sharded: the owner of the window's encode index ``i``, its held payload pinned for the step; settles a
        lazy due of ``due`` bytes per rank (the owner held it: rank_cached, else sent when queued; the other ranks:
        encoder_shared)."""
        key, rid = request.mm_features[i].identifier, request.request_id
        if not lazy:
            return placement.owner_holding(self.mirrors.payloads, key)  # chosen, sent and settled at admission
        rank = window.owners[i]
        if key in self.mirrors.payloads[rank]:
            self.mirrors.pin_for_step(rank, key)
            if due is not None:
                self.book.record(Delivery(rid, key, rank, Disposition.RANK_CACHED, due))
        if due is not None:
            self.book.record_ranks(rid, key, Disposition.ENCODER_SHARED, due, but=rank)
        return rank

    # --- progress and release ----------------------------------------------------------------------------------
    def advance(self, request: Request) -> None:
        """Unpins the items the request has now computed past (after a step)."""
        features, computed = request.mm_features, request.num_computed_tokens
        while request.item_cursor < len(features) and features[request.item_cursor].mm_position.end <= computed:
            self._unpin_item(request, request.item_cursor)
            request.item_cursor += 1

    def _unpin_item(self, request: Request, i: int) -> None:
        key = request.mm_features[i].identifier
        if i < request.pin_end:
            self.mirrors.encoder.unpin(key)
        if self._lazy(request):
            return  # lazy payloads are pinned for their step only
        if self.sharded:
            self.mirrors.payloads[placement.owner_holding(self.mirrors.payloads, key)].unpin(key)
            return  # only its owner pins it
        for mirror in self.mirrors.payloads:
            mirror.unpin(key)

    def release(self, request: Request, *, ended: bool = True) -> None:
        """Drops every pin and due the request holds: it ended (finished, cancelled, failed; its abandoned dues go
        to its Usage) or, ``ended=False``, it was preempted (it comes back as a new admission)."""
        n = len(request.mm_features)
        # Encoder pins cover [item_cursor, pin_end); full/strip payload pins cover [item_cursor, n).
        last = request.pin_end if self._lazy(request) else n
        for i in range(request.item_cursor, last):
            self._unpin_item(request, i)
        self.book.release(request, ended)
        self._deferring.discard(request.request_id)
        request.item_cursor = request.pin_end = n

    def reset(self) -> None:
        """The ranks lost every cache (recovery): empty mirrors, no step in flight."""
        self.mirrors.reset()
        self.book.reset()  # every running request comes back as a new admission
        self._deferring.clear()
        self.begin_step()
