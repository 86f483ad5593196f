"""Transfer decisions: which item payloads go to which rank in which step, and the mirrors of the ranks' caches.

Modes (``--transfer-mode``, docs/ARCHITECTURE.md §2.4):
- ``full``: at admission every item is PRESENT and its payload goes to every rank (the baseline).
- ``strip``: at admission items with ``end <= num_computed_tokens`` are STRIPPED (``strip_covered_mm_data``,
  keep_on_cpu fields kept for M-RoPE models); the others are PRESENT and go to every rank.
- ``lazy``: at admission covered items are STRIPPED and the others DEFERRED (metadata only); a payload travels in
  the step that schedules the item's encoder work, and only to ranks whose mirror lacks it.

Placement (``--encoder-placement``): ``replicated`` sends a payload to every rank and every rank encodes it;
``sharded`` gives each item to one owner rank — one that already holds its payload, else the rank with the fewest
encoder tokens assigned in the step (that can take it) — which alone receives the payload and encodes it; the
ranks share its output over their collective within the step (``EncoderInput.owner_rank``). Under ``sharded``,
full/strip send each admitted item's payload at admission to its owner only, and lazy to the owner in the step
that encodes it. A re-encode (after an eviction or a preemption) goes to a rank still holding the payload, or the
payload travels again.

Mirrors. One ``BudgetedLRU`` per rank mirrors its payload cache (bytes), one mirrors the group's encoder cache
(rows; every rank gets the same encoder inputs). Entries are pinned while something still needs them and only
unpinned entries are evicted (least recently used first), always by an explicit id in a step's control:
- encoder output: pinned by every request item from the step that encodes or reuses it until the request has
  computed past the item's end (a partially computed item keeps its output);
- payload, full/strip: pinned by every uncovered item from admission until computed past it; unpinned payloads
  are evicted at the next step (nothing would ever reuse them: these modes resend at every admission);
- payload, lazy: pinned only during the step that encodes it, then kept (LRU) for reuse.
Everything sent in a step is pinned for that step, so a step never evicts what it sends or uses.

Per-request cursors keep the work bounded: items ``[item_cursor, pin_end)`` are the request's pinned (started,
unfinished) items; a window only looks at items from ``item_cursor`` while they start before the window's end.

Strip's guarantee. ``strip`` sends every uncovered payload at admission, so a request whose uncovered payloads
exceed a rank's payload cache could never be admitted: the scheduler accepts a strip request whatever its total
(only what strip sends counts, and "cached X + new Y" is served when Y fits), and a request admitted with more
uncovered payload than the cache holds — a preempted or requeued request that lost its prefix, or a first
admission that misses — has its uncovered items DEFERRED instead, each payload sent in the step that encodes
it, as ``lazy`` does (``_deferring``). So every request that fits the per-item limits is eventually admitted.

Accounting (``ItemAccounting``; the metrics and each request's Usage add it up). Two rules make the counts
equal to what travelled:
- a delivery is one payload written to one rank in one step: ``sent`` / ``payload_bytes_sent`` count it once,
  for the request whose admission or encoder work first needed it in that step, however many occurrences (the
  same image twice in a prompt) or requests (one image in two requests admitted together) needed it. The sums
  therefore equal the payload frames the group writes (``mmcast_broadcast_bytes_total{kind="payload"}``, which
  adds the frame headers) and the ranks receive.
- "saved" compares with ``full``, which at each step writes every item of the requests admitted in that step
  once per rank. Each such (step, item) is one *delivery due*, settled exactly once per rank: written (``sent``),
  replaced by the owner's encoder output on the collective (``sharded``: ``encoder_shared``, every rank but the owner),
  prefix-covered (no admitted request of the step needed its payload: ``stripped``, charged to the first
  admitted request that had it), rank-cached (lazy: a rank already held the payload, or the group its encoder
  output, when the first request holding the due reached the item: ``rank_cached``), or abandoned (lazy: every
  request holding it ended before reaching it). A request preempted before reaching a deferred item drops its
  share of the due without a count: its resumption is a new admission with dues of its own.
A payload written again after an eviction (lazy's re-sends) is sent without a due: the wire carried it.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable

from common.errors import MmcastError
from common.ids import ItemId, RequestId
from common.multimodal import MultiModalFeatureSpec, PayloadState, strip_covered_mm_data
from scheduler_svc.cache_mirrors import BudgetedLRU
from scheduler_svc.output import ItemAccounting, PayloadSend, payload_nbytes
from scheduler_svc.request import Request

TRANSFER_MODES = ("full", "strip", "lazy")
PLACEMENTS = ("sharded", "replicated")


@dataclasses.dataclass
class _Due:
    """A delivery ``full`` would have made at one admission step: one item to every rank (see the module doc)."""

    nbytes: int  # payload bytes per rank
    first: RequestId  # the first request admitted in the step that has the item (charged if it is prefix-covered)
    needed: bool = False  # some request admitted in the step needs the payload (an uncovered occurrence; full: all)
    holders: int = 0  # lazy: requests admitted in the step that may still settle it by reaching the item
    open: bool = True  # lazy: not settled yet


@dataclasses.dataclass
class Window:
    """A tentative step window of one request, cut where an item's encoder work cannot be scheduled."""

    start: int  # first token of the window (the request's computed tokens)
    end: int  # one past the last token to compute
    encode: list[int]  # item indices whose encoder work is scheduled this step (first occurrence of an id)
    reuse: list[int]  # item indices newly reached whose encoder output is (or will this step be) held
    owners: dict[int, int] = dataclasses.field(default_factory=dict)  # sharded, lazy: encode index -> owner rank


class TransferPlanner:
    """Mirrors plus the per-step decisions; the scheduler calls it in a fixed order per step (see scheduler.py)."""

    def __init__(self, mode: str, uses_mrope: bool, num_ranks: int, payload_cache_bytes: int,
                 encoder_cache_tokens: int, placement: str = "replicated", encoder_row_bytes: int = 0) -> None:
        if mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode={mode!r}; choose one of {TRANSFER_MODES}")
        if placement not in PLACEMENTS:
            raise ValueError(f"encoder_placement={placement!r}; choose one of {PLACEMENTS}")
        self.mode = mode
        self.sharded = placement == "sharded"
        self.encoder_row_bytes = encoder_row_bytes  # bytes of one encoder-output row (the handshake's)
        self.uses_mrope = uses_mrope
        self.num_ranks = num_ranks
        self.encoder_cache_tokens = encoder_cache_tokens
        self.payloads = [BudgetedLRU(payload_cache_bytes) for _ in range(num_ranks)]
        self.encoder = BudgetedLRU(encoder_cache_tokens)
        self._dues: dict[RequestId, dict[ItemId, _Due]] = {}  # lazy dues each request holds, by item
        self._deferring: set[RequestId] = set()  # strip requests admitted with deferred payloads (too big)
        self._candidate: RequestId | None = None  # the request place_cursor prepared for admission
        self._candidate_defers = False  # whether that strip request's payloads would be deferred
        self.released = ItemAccounting()  # abandoned by requests that ended since the last plan (for the metrics)
        self.begin_step()

    # --- step lifecycle ----------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.rank_payloads: list[list[PayloadSend]] = [[] for _ in range(self.num_ranks)]
        self._sent: list[set[ItemId]] = [set() for _ in range(self.num_ranks)]
        self._step_pins: list[tuple[int, ItemId]] = []  # (rank, id) payload pins held for this step only
        self._evicted: list[set[ItemId]] = [set() for _ in range(self.num_ranks)]  # payloads evicted this step
        self._evicted_encoder: set[ItemId] = set()
        self.encoder_inputs: list[ItemId] = []
        self.encoder_owners: list[int | None] = []  # per encoder input: its owner (sharded) or None (every rank)
        self.encoder_tokens = 0  # encoder rows scheduled this step
        self._load = [0] * self.num_ranks  # sharded: encoder rows given to each rank this step (admission + windows)
        self._admission_owners: dict[ItemId, int] = {}  # sharded full/strip: owners chosen by admission_fits
        self._shared_credited: set[ItemId] = set()  # sharded full/strip: dues already settled as encoder_shared
        self.evict_payload_ids: dict[ItemId, None] = {}
        self.evict_encoder_ids: list[ItemId] = []
        self.accounting: dict[RequestId, ItemAccounting] = {}
        self._step_dues: dict[ItemId, _Due] = {}  # dues of this step's admissions, by item
        self.items_examined = 0

    def finish_step(self) -> None:
        """Settles this step's prefix-covered dues; full/strip: evicts every payload nothing needs any more (these
        modes never reuse one); what this step sends or uses is pinned, so it stays."""
        for due in self._step_dues.values():
            if not due.needed:
                acc = self.account_id(due.first)
                acc.stripped += self.num_ranks
                acc.bytes_saved_prefix_covered += self.num_ranks * due.nbytes
        if self.mode != "lazy":
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

    def _usable(self, key: ItemId) -> bool:
        """An id evicted earlier in this step may not be sent or used again in it: the control would carry the id
        both ways, and the ranks apply evictions after receiving the step's payloads."""
        return key not in self._evicted_encoder and not any(key in ev for ev in self._evicted)

    def account(self, request: Request) -> ItemAccounting:
        return self.account_id(request.request_id)

    def account_id(self, request_id: RequestId) -> ItemAccounting:
        acc = self.accounting.get(request_id)
        if acc is None:
            acc = self.accounting[request_id] = ItemAccounting()
        return acc

    def take_released(self) -> ItemAccounting:
        """What requests that ended since the last call left behind (already in their Usage): for the metrics."""
        out, self.released = self.released, ItemAccounting()
        return out

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
        if self.mode == "strip":  # the guarantee of the module doc: what cannot travel at once is deferred
            uncovered = {f.identifier: payload_nbytes(f) for f in request.mm_features[request.item_cursor :]}
            self._candidate_defers = sum(uncovered.values()) > min(m.budget for m in self.payloads)
        self._candidate = request.request_id  # the admission being tried: plan_window, admission_fits, commit

    def _admission_sends(self, request: Request) -> list[MultiModalFeatureSpec]:
        """Items whose payload goes out at admission (full: all; strip: uncovered; lazy: none)."""
        if self.mode == "full":
            return request.mm_features
        if not self._lazy(request):
            return request.mm_features[request.item_cursor :]
        return []

    def _least_loaded(self, ranks: Iterable[int], load: list[int]) -> int | None:
        return min(ranks, key=lambda r: (load[r], r), default=None)

    def _choose_owners(self, sends: list[MultiModalFeatureSpec]) -> dict[ItemId, int] | None:
        """sharded full/strip: an owner per item this admission sends (a rank holding it, else the least loaded that
        can take it beside the others chosen), or None when some item fits no rank."""
        extra = [0] * self.num_ranks
        keep: list[list[ItemId]] = [[] for _ in range(self.num_ranks)]
        load = list(self._load)
        owners: dict[ItemId, int] = {}
        for f in sends:
            key = f.identifier
            if key in owners:
                continue
            nbytes = payload_nbytes(f)
            rank = self._least_loaded((r for r, m in enumerate(self.payloads)
                                       if key in m and m.can_fit(extra[r], [*keep[r], key])), load)
            if rank is not None:
                keep[rank].append(key)
            else:
                rank = self._least_loaded((r for r, m in enumerate(self.payloads)
                                           if key not in m and m.can_fit(extra[r] + nbytes, keep[r])), load)
                if rank is None:
                    return None
                extra[rank] += nbytes
            owners[key] = rank
            load[rank] += f.mm_position.get_num_embeds()
        return owners

    def admission_fits(self, request: Request) -> bool:
        """full/strip: whether every rank (sharded: each item's owner) can take the payloads this admission sends."""
        sends = self._admission_sends(request)
        if not sends:
            return True
        if not all(self._usable(f.identifier) for f in sends):
            return False
        if self.sharded:
            owners = self._choose_owners(sends)
            self._admission_owners = owners or {}
            return owners is not None
        for mirror in self.payloads:
            new = {f.identifier: payload_nbytes(f) for f in sends if f.identifier not in mirror}
            held = [f.identifier for f in sends if f.identifier in mirror]
            if not mirror.can_fit(sum(new.values()), held):
                return False
        return True

    def commit_admission(self, request: Request, num_computed: int) -> list[MultiModalFeatureSpec]:
        """Decides each item's wire state, queues full/strip payloads, pins them; returns the wire items."""
        features = request.mm_features
        self.items_examined += len(features)
        acc = self.account(request)
        lazy = self._lazy(request)
        if lazy and self.mode == "strip":
            self._deferring.add(request.request_id)
        self._note_dues(request, lazy)
        if self.mode == "full":
            wire = list(features)
        else:
            wire = list(strip_covered_mm_data(features, num_computed, uses_mrope=self.uses_mrope) or [])
        if lazy:
            for i in range(request.item_cursor, len(wire)):
                wire[i] = dataclasses.replace(wire[i], payload_state=PayloadState.DEFERRED)
            return wire
        sends = self._admission_sends(request)
        first = len(features) - len(sends)  # full sends from item 0, strip from the first uncovered item
        if self.sharded:
            self._commit_sharded_admission(request, sends, first, acc)
            return wire
        for rank, mirror in enumerate(self.payloads):
            held = [f.identifier for f in sends if f.identifier in mirror]
            for key in held:
                mirror.pin(key)  # so that adding the others cannot evict them
            for k, f in enumerate(sends, start=first):
                self._send(rank, f, request, acc)
                if k >= request.item_cursor:
                    mirror.pin(f.identifier)  # held until the request computes past the item
            for key in held:
                mirror.unpin(key)
        return wire

    def _commit_sharded_admission(self, request: Request, sends: list[MultiModalFeatureSpec], first: int,
                                  acc: ItemAccounting) -> None:
        """sharded full/strip: each payload to its owner only (pinned there until computed past); the other ranks'
        deliveries are settled as encoder_shared, once per item and step."""
        owners = self._admission_owners
        held = [(owners[f.identifier], f.identifier) for f in sends if f.identifier in self.payloads[owners[f.identifier]]]
        for rank, key in held:
            self.payloads[rank].pin(key)
        for k, f in enumerate(sends, start=first):
            key, rank = f.identifier, owners[f.identifier]
            self._send(rank, f, request, acc)
            if k >= request.item_cursor:
                self.payloads[rank].pin(key)
            if key not in self._shared_credited:
                self._shared_credited.add(key)
                self._load[rank] += f.mm_position.get_num_embeds()
                acc.encoder_shared += self.num_ranks - 1
                acc.bytes_saved_encoder_shared += (self.num_ranks - 1) * payload_nbytes(f)
        for rank, key in held:
            self.payloads[rank].unpin(key)

    def _payload_rank(self, key: ItemId) -> int:
        """sharded full/strip: the rank whose mirror pins the item's payload (its owner)."""
        for rank, mirror in enumerate(self.payloads):
            if mirror.pinned(key):
                return rank
        raise MmcastError(f"internal: no rank holds the payload of item {key[:16]} (sharded {self.mode} mode pins it "
                          "on its owner at admission)")

    def _note_dues(self, request: Request, lazy: bool) -> None:
        """Registers the request's items in this step's dues (one per item, whatever the occurrences/requests);
        a lazy request holds the dues of the items it still has to reach."""
        held = self._dues.setdefault(request.request_id, {})
        for k, f in enumerate(request.mm_features):
            key = f.identifier
            due = self._step_dues.get(key)
            if due is None:
                due = self._step_dues[key] = _Due(payload_nbytes(f), request.request_id)
            if self.mode == "full" or k >= request.item_cursor:
                due.needed = True
                if lazy and key not in held:
                    held[key] = due
                    due.holders += 1

    def _settle(self, request: Request, key: ItemId) -> _Due | None:
        """The open due the request holds for ``key``, now settled by the caller; None when there is none."""
        due = self._dues.get(request.request_id, {}).get(key)
        if due is None or not due.open:
            return None
        due.open = False
        return due

    def _send(self, rank: int, feature: MultiModalFeatureSpec, request: Request, acc: ItemAccounting) -> None:
        """Queues the payload for a rank and pins it for the step; the first time in the step it is queued for
        that rank, counts the delivery for this request (what the wire carries: once per item, rank and step)."""
        key = feature.identifier
        mirror = self.payloads[rank]
        if key in mirror:
            mirror.pin(key)  # full/strip resend what the rank holds; or a second item with this id this step
        else:
            for victim in mirror.add(key, payload_nbytes(feature)):
                self._note_payload_eviction(rank, victim)
        if key not in self._sent[rank]:
            self._sent[rank].add(key)
            self.rank_payloads[rank].append(PayloadSend(key, feature, request.request_id))
            acc.sent += 1
            acc.payload_bytes_sent += payload_nbytes(feature)
        self._step_pins.append((rank, key))

    # --- windows -----------------------------------------------------------------------------------------------
    def plan_window(self, request: Request, start: int, end: int) -> Window:
        """Cuts ``[start, end)`` before the first item whose encoder work cannot be scheduled; changes nothing."""
        features = request.mm_features
        encode: list[int] = []
        reuse: list[int] = []
        enc_ids: set[ItemId] = set()
        keep_enc: list[ItemId] = []
        enc_tokens = 0
        pay_bytes = [0] * self.num_ranks
        keep_pay: list[list[ItemId]] = [[] for _ in range(self.num_ranks)]
        budget_left = self.encoder_cache_tokens - self.encoder_tokens
        lazy = self._lazy(request)
        owners: dict[int, int] = {}
        load = list(self._load)
        i = request.item_cursor
        while i < len(features) and features[i].mm_position.offset < end:
            self.items_examined += 1
            if i < request.pin_end:
                i += 1
                continue  # started in an earlier step: its encoder output is pinned
            f = features[i]
            key = f.identifier
            # Every check is cumulative over the window: what it encodes must fit beside everything it keeps,
            # including what it keeps after an earlier item was judged to fit.
            if key in enc_ids or (key in self.encoder and self.encoder.can_fit(enc_tokens, [*keep_enc, key])):
                reuse.append(i)
                keep_enc.append(key)
                i += 1
                continue
            tokens = f.mm_position.get_num_embeds()
            fits = (
                key not in self.encoder  # held but its neighbours' room depends on evicting it: wait
                and self._usable(key)
                and enc_tokens + tokens <= budget_left
                and self.encoder.can_fit(enc_tokens + tokens, keep_enc)
            )
            if fits and lazy and self.sharded:
                owner = self._window_owner(key, payload_nbytes(f), pay_bytes, keep_pay, load)
                fits = owner is not None
                if fits:
                    owners[i] = owner
                    load[owner] += tokens
            elif fits and lazy:
                nbytes = payload_nbytes(f)
                for rank, mirror in enumerate(self.payloads):
                    if key in mirror:
                        fits = mirror.can_fit(pay_bytes[rank], [*keep_pay[rank], key])
                    else:
                        fits = mirror.can_fit(pay_bytes[rank] + nbytes, keep_pay[rank])
                    if not fits:
                        break
                if fits:
                    for rank, mirror in enumerate(self.payloads):
                        if key in mirror:
                            keep_pay[rank].append(key)
                        else:
                            pay_bytes[rank] += nbytes
            if not fits:
                end = max(f.mm_position.offset, start)  # compute up to the item; it waits for room
                break
            encode.append(i)
            enc_ids.add(key)
            enc_tokens += tokens
            i += 1
        return Window(start, end, encode, reuse, owners)

    def _window_owner(self, key: ItemId, nbytes: int, pay_bytes: list[int], keep_pay: list[list[ItemId]],
                      load: list[int]) -> int | None:
        """sharded lazy: the owner of an item to encode — a rank holding its payload (nothing travels), else the
        least loaded rank that can take it beside the window's other sends; None when none can. Updates the
        window's tallies for the chosen rank."""
        rank = self._least_loaded((r for r, m in enumerate(self.payloads)
                                   if key in m and m.can_fit(pay_bytes[r], [*keep_pay[r], key])), load)
        if rank is not None:
            keep_pay[rank].append(key)
            return rank
        rank = self._least_loaded((r for r, m in enumerate(self.payloads)
                                   if key not in m and m.can_fit(pay_bytes[r] + nbytes, keep_pay[r])), load)
        if rank is not None:
            pay_bytes[rank] += nbytes
        return rank

    def commit_window(self, request: Request, window: Window) -> None:
        """Pins encoder outputs, schedules encoder inputs and (lazy) payload sends; counts lazy deliveries.
        Everything already held is pinned before anything is added, so additions never evict it."""
        features = request.mm_features
        acc = self.account(request)
        lazy = self._lazy(request)
        held = [i for i in window.reuse if features[i].identifier in self.encoder]
        later = [i for i in window.reuse if features[i].identifier not in self.encoder]  # encoded by this window
        for i in held:
            self.encoder.pin(features[i].identifier)
        owners: dict[int, int] = {}
        for i in window.encode:
            key = features[i].identifier
            due = self._settle(request, key) if lazy else None  # settled per rank: held here, else sent below
            if self.sharded:
                owners[i] = self._commit_owner(request, i, window, due, acc)
                continue
            for rank, mirror in enumerate(self.payloads):
                if not lazy:
                    if mirror.pinned(key) == 0:
                        raise MmcastError(f"internal: rank {rank} does not hold the payload of item {key[:16]} "
                                          f"({self.mode} mode sends it at admission)")
                elif key in mirror:  # held since an earlier step (this step's sends come with encoding = reuse)
                    mirror.pin(key)
                    self._step_pins.append((rank, key))
                    if due is not None:
                        acc.rank_cached += 1
                        acc.bytes_saved_rank_cached += due.nbytes
        for i in window.encode:
            f = features[i]
            key = f.identifier
            tokens = f.mm_position.get_num_embeds()
            for victim in self.encoder.add(key, tokens):
                self.evict_encoder_ids.append(victim)
                self._evicted_encoder.add(victim)
            self.encoder_inputs.append(key)
            self.encoder_owners.append(owners.get(i))
            self.encoder_tokens += tokens
            if self.sharded:
                acc.encoder_runs += 1
                acc.encoder_output_bytes_shared += (self.num_ranks - 1) * tokens * self.encoder_row_bytes
                self._load[owners[i]] += tokens
                if lazy and key not in self._sent[owners[i]] and key not in self.payloads[owners[i]]:
                    self._send(owners[i], f, request, acc)
                continue
            acc.encoder_runs += self.num_ranks
            if lazy:
                for rank, mirror in enumerate(self.payloads):
                    if key not in self._sent[rank] and key not in mirror:
                        self._send(rank, f, request, acc)
        for i in later:
            self.encoder.pin(features[i].identifier)
        if lazy:
            for i in window.reuse:  # the ranks hold (or get this step) its encoder output: no payload needed
                due = self._settle(request, features[i].identifier)
                if due is not None:
                    acc.rank_cached += self.num_ranks
                    acc.bytes_saved_rank_cached += self.num_ranks * due.nbytes
        reached = window.encode + window.reuse
        if reached:
            request.pin_end = max(request.pin_end, max(reached) + 1)

    def _commit_owner(self, request: Request, i: int, window: Window, due: _Due | None, acc: ItemAccounting) -> int:
        """sharded: the owner of encode index ``i``, its held payload pinned for the step; settles a lazy due (the
        owner held it: rank_cached, else sent when queued; every other rank: encoder_shared)."""
        key = request.mm_features[i].identifier
        if not self._lazy(request):
            return self._payload_rank(key)
        rank = window.owners[i]
        mirror = self.payloads[rank]
        if key in mirror:
            mirror.pin(key)
            self._step_pins.append((rank, key))
            if due is not None:
                acc.rank_cached += 1
                acc.bytes_saved_rank_cached += due.nbytes
        if due is not None:
            acc.encoder_shared += self.num_ranks - 1
            acc.bytes_saved_encoder_shared += (self.num_ranks - 1) * due.nbytes
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
            self.encoder.unpin(key)
        if self._lazy(request):
            return
        if self.sharded:
            self.payloads[self._payload_rank(key)].unpin(key)
            return
        for mirror in self.payloads:
            mirror.unpin(key)

    def release(self, request: Request, *, ended: bool = True) -> int:
        """Drops every pin the request holds: it ended (finished, cancelled, failed) or, ``ended=False``, it was
        preempted (it comes back as a new admission). Returns the deliveries abandoned: the lazy dues whose last
        holder was this ended request (times ranks; also added to ``released`` for the metrics)."""
        n = len(request.mm_features)
        # Encoder pins cover [item_cursor, pin_end); full/strip payload pins cover [item_cursor, n).
        last = request.pin_end if self._lazy(request) else n
        for i in range(request.item_cursor, last):
            self._unpin_item(request, i)
        abandoned = 0
        for due in self._dues.pop(request.request_id, {}).values():
            due.holders -= 1
            if due.open and due.holders == 0:
                due.open = False
                abandoned += self.num_ranks if ended else 0  # preempted: its resumption has dues of its own
        self._deferring.discard(request.request_id)
        self.released.abandoned += abandoned
        request.item_cursor = request.pin_end = n
        return abandoned

    def forget_encoder(self, key: ItemId) -> None:
        """Drops an encoder-mirror entry the ranks never stored (its encoding failed), once nothing pins it."""
        if key in self.encoder and not self.encoder.pinned(key):
            self.encoder.discard(key)

    def reset(self) -> None:
        """The ranks lost every cache (recovery): empty mirrors, no step in flight."""
        self.payloads = [BudgetedLRU(m.budget) for m in self.payloads]
        self.encoder = BudgetedLRU(self.encoder_cache_tokens)
        self._dues.clear()  # every running request comes back as a new admission
        self._deferring.clear()
        self.begin_step()
