"""The state of one scheduler stream on a rank, and how a step is applied to it.

A step runs in three phases:

1. ``check``: checks the whole step against the state *as it will be* after this step's evictions, finishes,
   admissions and deltas — every request id, count, block id, token id, payload and encoder output the step needs
   — without changing anything (one named check per rule, ``worker_svc/step_checks.py``). Every rank sees the
   same control bytes, so every rank reaches the same verdict, and a bad step fails on all ranks before any of
   them starts collective work.
2. ``commit``: applies evictions, received payloads, finishes, admissions and deltas (pure bookkeeping).
3. ``execute``: runs the vision encoder for the scheduled items, then the language model once over every scheduled
   window (its KV written into and read from the pool in place, through each request's block table), and samples
   on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import torch

from common import item_proto
from common.errors import InvalidArgument
from common.ids import ItemId, RequestId
from common.multimodal import (
    PayloadEncoding,
)
from common.sample import Sample
from mmcast.v1 import worker_pb2
from worker_svc import step_checks as checks
from worker_svc.caches import EncoderCache, FrameError, PayloadAssembler, PayloadCache
from worker_svc.item_pixels import item_pixels
from worker_svc.last_sampled import LastSampled, extra_tokens
from worker_svc.late_masks import LateMasks
from worker_svc.metrics import WorkerMetrics
from worker_svc.request_state import RequestState
from worker_svc.runner import ForwardInput
from worker_svc.step_errors import StepError, code
from worker_svc.step_sampling import sample_step
from worker_svc.token_mask import UnpackedMasks, check_masks_follow, check_token_masks

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _CheckedStep:
    control: worker_pb2.StepControl
    finished: list[RequestId]
    new: list[RequestState]
    running: list[tuple[RequestState, worker_pb2.RunningRequest]]
    incoming: dict[ItemId, dict[str, torch.Tensor]]  # payloads received for this step
    encode: list[tuple[ItemId, object, int | None]]  # (identifier, feature, owner rank or None = every rank);
    # the feature holds its payload on the ranks that encode it
    windows: list[tuple[RequestState, int, int]]  # (request, start, end) in control order
    payload_hits: int = 0
    encoder_hits: int = 0
    payload_queries: int = 0  # items this rank encodes: each needs its payload (hit: held from an earlier step)
    encoder_queries: int = 0  # (window, item) uses of an encoder output (hit: computed in an earlier step)
    token_masks: dict = dataclasses.field(default_factory=dict)  # request -> its TokenMask (structured output)
    masks_follow: frozenset = frozenset()  # requests whose masks come in the step's LateTokenMasks (rank 0 waits)


@dataclasses.dataclass
class StepOutcome:
    sampled: list[tuple[RequestId, Sample]]  # rank 0: the token of every request the step sampled, except...
    encoder_seconds: float
    encoder_items: int
    failed: list[tuple[RequestId, str]] = dataclasses.field(default_factory=list)  # ...these: (id, why) (rank 0)
    item_failures: list[tuple[ItemId, str]] = dataclasses.field(default_factory=list)  # owned items that failed
    encoder_runs: int = 0  # items this rank encoded
    collective_bytes: int = 0  # encoder-output bytes sent or received over the collective
    collective_seconds: float = 0.0
    preprocess_seconds: float = 0.0  # decoding + preprocessing encoded payloads
    forward_seconds: float = 0.0  # the language model's forward over every window
    sample_seconds: float = 0.0  # sampling (rank 0)


@dataclasses.dataclass
class SamplesAwaitMasks:
    """Rank 0, a step whose control announced ``masks_follow``: its forward is done and its tokens wait for the
    late masks. ``finish(masks)`` (request -> TokenMask, as ``LateMasks.take`` returns them) samples and gives the
    step's ``StepOutcome``; the servicer has it called (``Worker.finish_step``) once the frame is read
    (``worker_svc/late_masks.py``)."""

    step_id: int
    finish: Callable[[dict], StepOutcome]


def _window_positions(state: RequestState, start: int, end: int) -> torch.Tensor | int:
    """A window's ``ForwardInput.positions``: the first position of a window past the prompt, else its columns."""
    offset = state.window_offset(start)
    return offset if offset is not None else state.window_positions(start, end)


class Session:
    """One stream's requests and caches. Not thread-safe: one step at a time applies to it, on the compute thread
    or, for a short one, on the event loop's (``worker_svc/inline_steps.py``)."""

    def __init__(
        self,
        runner,
        *,
        rank: int,
        payload_cache_bytes: int,
        encoder_cache_tokens: int,
        max_tensor_bytes: int,
        metrics: WorkerMetrics | None = None,
        group=None,
        images=None,
        videos=None,
        late_mask_timeout: float = 60.0,
    ) -> None:
        """``group``: the rank's ``worker_svc.process_group.Group`` (sharded placement's collectives; None for one rank);
        ``images``: a ``common.image_input.ImageInput`` with the limits the scheduler's handshake sent (None: encoded
        payloads are refused); ``videos``: a ``common.video_input.VideoInput`` likewise (None: encoded videos are
        refused); ``late_mask_timeout``: rank 0's longest wait for a step's late masks (--late-mask-timeout-seconds)."""
        self.runner = runner
        self.group = group
        self.images = images
        self.videos = videos
        self.rank = rank
        self.metrics = metrics
        self.requests: dict[RequestId, RequestState] = {}
        self.assembler = PayloadAssembler(max_tensor_bytes, max_pending_bytes=payload_cache_bytes)
        self.payloads = PayloadCache(payload_cache_bytes)
        self.encoded = EncoderCache(encoder_cache_tokens)
        self.items: dict[ItemId, list] = {}  # identifier -> [item message, number of held requests with it]
        self.last_step_id = 0
        self.written: set[int] = set()  # KV pool blocks this stream's requests wrote: the prefixes it may read
        self.last_sampled = LastSampled()  # the previous step's samples: inputs of async-scheduled deltas
        self.unpacked_masks = UnpackedMasks()  # rank 0's grammar masks, unpacked once while they repeat
        self.late_mask_timeout = late_mask_timeout

    # --- frames ----------------------------------------------------------------------------------------------

    def receive_payload(self, frame: worker_pb2.PayloadFrame) -> None:
        try:
            self.assembler.add(frame)
        except FrameError as exc:
            raise StepError(code.BAD_TENSOR, str(exc), item_identifier=frame.item_identifier) from None

    def late_masks_of(self, control: worker_pb2.StepControl) -> LateMasks:
        """Rank 0, for ``control`` with ``masks_follow``: what its late masks are checked against once they come
        (``worker_svc/late_masks.py``)."""
        return LateMasks.of(control.step_id, control.masks_follow, self.runner.vocab_size, self.late_mask_timeout)

    def clear(self) -> None:
        """Drops every request and cache entry of this stream."""
        self.requests.clear()
        self.items.clear()
        self.assembler.clear()
        self.payloads.clear()
        self.encoded.clear()
        self.written.clear()
        self.last_sampled.clear()
        self._report_sizes()

    # --- phase 1: validate -----------------------------------------------------------------------------------

    def check(self, control: worker_pb2.StepControl) -> _CheckedStep:
        """Every rule the step must satisfy, in this order (``worker_svc/step_checks.py``); the first broken one
        raises its ``StepError``. Changes nothing but taking the payloads assembled for the step."""
        r = self.runner
        checks.check_step_id(control, self.last_step_id)
        incoming = checks.take_assembled(self.assembler)
        finished = checks.check_finished(control, self.requests)
        held = set(self.requests) - set(finished)
        new, step_items = checks.check_new_requests(control, held, r, self.written)
        running = checks.check_running(control, held, new, self.requests, r)
        self.last_sampled.check(running)
        windows = checks.check_windows(control, new, running, r)
        encode, encoded_after, payload_hits, payload_queries = checks.check_encoder_inputs(
            control,
            incoming,
            step_items,
            items=self.items,
            payloads=self.payloads,
            encoded=self.encoded,
            rank=self.rank,
            world_size=getattr(self.group, "world_size", 1),
            images_allowed=self.images is not None,
            videos=self.videos,
            runner=r,
        )
        encoder_hits, encoder_queries = checks.check_encoder_outputs_for_windows(windows, encode, encoded_after)
        checks.check_payload_budget(control, incoming, self.payloads)
        brought = {s.request_id: len(d.new_token_ids) + extra_tokens(d) for s, d in running}
        masks = check_token_masks(control, windows, r.vocab_size, brought)
        follow = check_masks_follow(control, windows, brought)
        return _CheckedStep(
            control,
            finished,
            new,
            running,
            incoming,
            encode,
            windows,
            payload_hits,
            encoder_hits,
            payload_queries,
            encoder_queries,
            masks,
            follow,
        )

    # --- phase 2: bookkeeping --------------------------------------------------------------------------------

    def _register(self, state: RequestState) -> None:
        for item in state.item_msgs:
            entry = self.items.get(item.identifier)
            if entry is None:
                self.items[ItemId(item.identifier)] = [item, 1]
                continue
            entry[1] += 1
            if item_proto.payload_field_headers(item):
                entry[0] = item  # prefer a message that announces the payload fields

    def _unregister(self, state: RequestState) -> None:
        for item in state.item_msgs:
            entry = self.items[item.identifier]
            entry[1] -= 1
            if entry[1] == 0:
                del self.items[item.identifier]

    def commit(self, checked: _CheckedStep) -> None:
        control = checked.control
        self.last_step_id = control.step_id
        if control.reset_caches:
            self.payloads.clear()
            self.encoded.clear()
        self.payloads.evict(control.evict_payload_ids)
        self.encoded.evict(control.evict_encoder_ids)
        self.payloads.merge(checked.incoming)
        for rid in checked.finished:
            self._unregister(self.requests.pop(rid))
        for state in checked.new:
            self.requests[state.request_id] = state
            self._register(state)
            for src, dst, count in state.kv_moves:  # a live turn's compaction, before any forward of the step
                self.runner.pool.move(state.block_ids, src, dst, count)
        last = self.last_sampled.resolve(checked.running, self.rank, self.group)
        for state, delta in checked.running:
            state.token_ids.extend(delta.new_token_ids)
            state.num_output_tokens += len(delta.new_token_ids)
            if delta.input_is_last_sampled:
                state.token_ids.append(last[state.request_id])
                state.num_output_tokens += 1
            state.block_ids.extend(delta.new_block_ids)
        if self.metrics is not None:
            m = self.metrics
            m.cache_queries.labels(cache="payload").inc(checked.payload_queries)
            m.cache_hits.labels(cache="payload").inc(checked.payload_hits)
            m.cache_queries.labels(cache="encoder").inc(checked.encoder_queries)
            m.cache_hits.labels(cache="encoder").inc(checked.encoder_hits)

    # --- phase 3: compute ------------------------------------------------------------------------------------

    def _encode_step(self, checked: _CheckedStep, outcome: StepOutcome) -> set[ItemId]:
        """Runs the step's encoder work and fills the encoder cache; returns the items that failed (known to every
        rank alike). Each rank first encodes what it owns (every item under replicated placement); with several
        ranks they then exchange one status per item and each owner broadcasts its outputs, in control order."""
        r = self.runner
        t0 = time.perf_counter()
        rows_of: dict[ItemId, torch.Tensor] = {}
        failures: dict[ItemId, str] = {}
        for ident, feature, owner in checked.encode:
            if owner is not None and owner != self.rank:
                continue
            p0, encoded = time.perf_counter(), feature.encoding is PayloadEncoding.ENCODED
            try:
                feature = item_pixels(ident, feature, self.images, self.videos, r.family.grid_field)
            except InvalidArgument as exc:
                failures[ident] = exc.message
                continue
            finally:
                outcome.preprocess_seconds += (time.perf_counter() - p0) if encoded else 0.0
            rows = r.encode(feature)
            want = feature.mm_position.get_num_embeds()
            if rows.shape[0] != want:  # the item's failure, reported like a bad file: the peers must learn of it
                failures[ident] = (
                    f"item {ident[:16]}: the encoder produced {rows.shape[0]} rows, its placeholder range takes {want}"
                )
                continue
            rows_of[ident] = rows if owner is None else rows.to(r.row_dtype)
            outcome.encoder_runs += 1
        outcome.encoder_seconds = time.perf_counter() - t0
        failed = set(failures)
        if self.group is not None and self.group.world_size > 1 and checked.encode:
            t1 = time.perf_counter()
            flags = self.group.any_failed([int(ident in failures) for ident, _, _ in checked.encode])
            failed = {ident for (ident, _, _), flag in zip(checked.encode, flags, strict=True) if flag}
            for ident, feature, owner in checked.encode:
                if owner is None or ident in failed:
                    continue
                rows = rows_of[ident] if owner == self.rank else r.empty_rows(feature.mm_position.get_num_embeds())
                self.group.broadcast(rows, owner)
                rows_of[ident] = rows
                outcome.collective_bytes += rows.numel() * rows.element_size()
            outcome.collective_seconds = time.perf_counter() - t1
        for ident, rows in rows_of.items():
            self.encoded.put(ident, rows)
        outcome.item_failures = sorted(failures.items())
        if self.metrics is not None:
            m = self.metrics
            if checked.encode:
                m.encoder_seconds.observe(outcome.encoder_seconds)
            m.encoder_runs.inc(outcome.encoder_runs)
            m.image_failures.inc(len(failures))
            if outcome.preprocess_seconds:
                m.preprocess_seconds.observe(outcome.preprocess_seconds)
            if outcome.collective_seconds:
                m.encoder_collective_bytes.inc(outcome.collective_bytes)
                m.encoder_collective_seconds.observe(outcome.collective_seconds)
        return failed

    def execute(self, checked: _CheckedStep) -> StepOutcome | SamplesAwaitMasks:
        r = self.runner
        outcome = StepOutcome([], 0.0, len(checked.encode))
        failed_items = self._encode_step(checked, outcome)
        windows = checked.windows
        if failed_items:  # every rank skips the same windows: those that reach an item no rank could encode
            windows = [
                (s, a, b)
                for s, a, b in windows
                if not any(s.features[i].identifier in failed_items for i in s.overlapping(a, b))
            ]

        inputs: list[ForwardInput] = []
        for state, start, end in windows:
            mm_rows = []
            for index in state.overlapping(start, end):
                local, rows = state.item_rows(index, start, end)
                mm_rows.append((local, self.encoded.get(state.features[index].identifier)[rows]))
            inputs.append(
                ForwardInput(
                    block_ids=state.block_ids,
                    start=start,
                    token_ids=state.token_ids[start:end],
                    positions=_window_positions(state, start, end),
                    mm_rows=mm_rows,
                    want_logits=end == len(state.token_ids),
                )
            )
        t0 = time.perf_counter()
        logits = r.forward(inputs)
        t1 = time.perf_counter()
        outcome.forward_seconds = t1 - t0

        sampling: list[RequestState] = []
        for (state, _start, end), row in zip(windows, logits.rows, strict=True):
            state.num_computed = end
            full = end // r.block_size  # blocks now complete in the pool: a later request's prefix may read them
            if state.live:
                full = -(-end // r.block_size)  # a live session's next turn also reads its partial last block
            self.written.update(state.block_ids[state.blocks_in_pool : full])
            state.blocks_in_pool = max(state.blocks_in_pool, full)
            if row is not None and self.rank == 0:
                sampling.append(state)
        outcome.sample_seconds = time.perf_counter() - t1  # the block bookkeeping above is negligible
        if checked.masks_follow and self.rank == 0:
            return SamplesAwaitMasks(
                checked.control.step_id,
                lambda late: self._sample(sampling, logits, {**checked.token_masks, **late}, windows, outcome),
            )
        return self._sample(sampling, logits, checked.token_masks, windows, outcome)

    def _sample(
        self, sampling: list[RequestState], logits, masks: dict, windows: list, outcome: StepOutcome
    ) -> StepOutcome:
        """Rank 0 draws the step's tokens (``sample_step``); every rank records what the next step's deltas
        need."""
        t0 = time.perf_counter()
        if sampling:
            drawn_all = sample_step(sampling, logits, masks, self.rank, self.unpacked_masks)
            for state, drawn in zip(sampling, drawn_all, strict=True):
                (outcome.sampled if isinstance(drawn, Sample) else outcome.failed).append((state.request_id, drawn))
        outcome.sample_seconds += time.perf_counter() - t0
        self.last_sampled.record(windows, outcome.sampled)
        self._report_sizes()
        return outcome

    def _report_sizes(self) -> None:
        if self.metrics is not None:
            self.metrics.set_cache_sizes(self.payloads.nbytes, len(self.payloads), self.encoded.tokens)
