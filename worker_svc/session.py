"""The state of one scheduler stream on a rank, and how a step is applied to it.

A step runs in three phases:

1. ``plan``: checks the whole step against the state *as it will be* after this step's evictions, finishes,
   admissions and deltas — every request id, count, block id, token id, payload and encoder output the step needs
   — without changing anything. Every rank sees the same control bytes, so every rank reaches the same verdict, and
   a bad step fails on all ranks before any of them starts collective work.
2. ``commit``: applies evictions, received payloads, finishes, admissions and deltas (pure bookkeeping).
3. ``execute``: runs the vision encoder for the scheduled items, then the language model once over every scheduled
   window (its KV written into and read from the pool in place, through each request's block table), and samples
   on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from common import wire
from common.errors import InvalidArgument
from common.ids import ItemId, RequestId
from common.multimodal import ENCODED_FIELD, MultiModalFieldElem, MultiModalKwargsItem, PayloadEncoding
from mmcast.v1 import worker_pb2
from worker_svc.caches import EncoderCache, FrameError, PayloadAssembler, PayloadCache
from worker_svc.metrics import WorkerMetrics
from worker_svc.requests import RequestState, admit, check_blocks, check_prefix_written, check_tokens
from worker_svc.runner import ForwardInput, encoder_fields
from worker_svc.sampling import Sample, SamplingError, sample
from worker_svc.step_errors import StepError, code

log = logging.getLogger(__name__)

@dataclasses.dataclass
class _Plan:
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


class Session:
    """One stream's requests and caches. Not thread-safe: one compute thread applies steps."""

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
    ) -> None:
        """``group``: the rank's ``worker_svc.group.Group`` (sharded placement's collectives; None for one rank);
        ``images``: a ``common.image_input.ImageInput`` with the limits the scheduler's handshake sent (None: encoded
        payloads are refused)."""
        self.runner = runner
        self.group = group
        self.images = images
        self.rank = rank
        self.metrics = metrics
        self.requests: dict[RequestId, RequestState] = {}
        self.assembler = PayloadAssembler(max_tensor_bytes, max_pending_bytes=payload_cache_bytes)
        self.payloads = PayloadCache(payload_cache_bytes)
        self.encoded = EncoderCache(encoder_cache_tokens)
        self.items: dict[ItemId, list] = {}  # identifier -> [item message, number of held requests with it]
        self.last_step_id = 0
        self.written: set[int] = set()  # KV pool blocks this stream's requests wrote: the prefixes it may read

    # --- frames ----------------------------------------------------------------------------------------------

    def receive_payload(self, frame: worker_pb2.PayloadFrame) -> None:
        try:
            self.assembler.add(frame)
        except FrameError as exc:
            raise StepError(code.BAD_TENSOR, str(exc), item_identifier=frame.item_identifier) from None

    def step(self, control: worker_pb2.StepControl) -> StepOutcome:
        plan = self.plan(control)
        self.commit(plan)
        return self.execute(plan)

    def clear(self) -> None:
        """Drops every request and cache entry of this stream."""
        self.requests.clear()
        self.items.clear()
        self.assembler.clear()
        self.payloads.clear()
        self.encoded.clear()
        self.written.clear()
        self._report_sizes()

    # --- phase 1: validate -----------------------------------------------------------------------------------

    def plan(self, control: worker_pb2.StepControl) -> _Plan:
        r = self.runner
        if control.step_id <= self.last_step_id:
            raise StepError(
                code.STATE_MISMATCH, f"step_id {control.step_id} is not above the previous step_id {self.last_step_id}"
            )
        try:
            incoming = self.assembler.take()
        except FrameError as exc:
            raise StepError(code.BAD_TENSOR, str(exc)) from None
        reset = control.reset_caches
        gone_payloads = set(control.evict_payload_ids)
        gone_encoded = set(control.evict_encoder_ids)

        finished: list[RequestId] = []
        for rid in control.finished_request_ids:
            if rid not in self.requests or rid in finished:
                raise StepError(
                    code.UNKNOWN_REQUEST, f"finished_request_ids names {rid!r}, which this rank does not hold", rid
                )
            finished.append(RequestId(rid))
        held = set(self.requests) - set(finished)

        new: list[RequestState] = []
        step_items: dict[ItemId, object] = {}
        for msg in control.new_requests:
            if msg.request_id in held or any(s.request_id == msg.request_id for s in new):
                raise StepError(
                    code.STATE_MISMATCH,
                    f"new_requests[{msg.request_id}]: this rank already holds the request",
                    msg.request_id,
                )
            state = admit(
                msg,
                vocab_size=r.vocab_size,
                num_blocks=r.pool.num_blocks,
                block_size=r.block_size,
                max_model_len=r.max_model_len,
                rope_kwargs=r.rope_kwargs if r.uses_mrope else None,
            )
            check_prefix_written(state, self.written, r.block_size)
            new.append(state)
            for item in state.item_msgs:
                if item.identifier not in step_items or wire.payload_field_headers(item):
                    step_items[ItemId(item.identifier)] = item

        running: list[tuple[RequestState, worker_pb2.RunningRequest]] = []
        seen: set[str] = {s.request_id for s in new}
        for delta in control.running:
            rid = delta.request_id
            where = f"running[{rid}]"
            if rid not in held or rid in seen:
                raise StepError(code.UNKNOWN_REQUEST, f"{where}: this rank does not hold the request", rid)
            seen.add(rid)
            state = self.requests[RequestId(rid)]
            if delta.num_computed_tokens != state.num_computed:
                raise StepError(
                    code.STATE_MISMATCH,
                    f"{where}.num_computed_tokens={delta.num_computed_tokens}, this rank computed {state.num_computed}",
                    rid,
                )
            check_tokens(delta.new_token_ids, r.vocab_size, f"{where}.new_token_ids", rid)
            check_blocks(delta.new_block_ids, r.pool.num_blocks, f"{where}.new_block_ids", rid)
            running.append((state, delta))

        windows: list[tuple[RequestState, int, int]] = []
        for state, count, num_tokens, num_blocks in [
            (s, m.num_scheduled_tokens, len(s.token_ids), len(s.block_ids))
            for s, m in zip(new, control.new_requests, strict=True)
        ] + [
            (
                s,
                d.num_scheduled_tokens,
                len(s.token_ids) + len(d.new_token_ids),
                len(s.block_ids) + len(d.new_block_ids),
            )
            for s, d in running
        ]:
            if count == 0:
                continue  # held but not computed this step
            start, end = state.num_computed, state.num_computed + count
            rid = state.request_id
            if end > num_tokens:
                raise StepError(
                    code.STATE_MISMATCH,
                    f"request {rid}: num_scheduled_tokens={count} from {start} reaches token {end}, the rank knows "
                    f"{num_tokens} tokens",
                    rid,
                )
            if r.max_model_len and end > r.max_model_len:
                raise StepError(code.OUT_OF_RANGE, f"request {rid}: {end} tokens exceed max_model_len", rid)
            if -(-end // r.block_size) > num_blocks:  # every token computed this step is written at its slot
                raise StepError(
                    code.STATE_MISMATCH,
                    f"request {rid}: {end} computed tokens need {-(-end // r.block_size)} blocks of "
                    f"{r.block_size}, the block table holds {num_blocks}",
                    rid,
                )
            windows.append((state, start, end))

        def lookup(ident: str):
            return step_items.get(ident) or (self.items.get(ident) or [None])[0]

        encoded_after = set() if reset else set(self.encoded.entries) - gone_encoded
        encoder_tokens = (
            0
            if reset
            else self.encoded.tokens
            - sum(self.encoded.entries[i].shape[0] for i in gone_encoded if i in self.encoded.entries)
        )
        encode: list[tuple[ItemId, object, int | None]] = []
        plan_hits = 0
        world = getattr(self.group, "world_size", 1)
        for enc in control.encoder_inputs:
            ident = ItemId(enc.item_identifier)
            if ident in encoded_after:
                continue  # already encoded on this rank; the scheduler's mirror may lag one step
            msg = lookup(ident)
            if msg is None:
                raise StepError(
                    code.STATE_MISMATCH,
                    f"encoder_inputs names item {ident[:16]}, which no request held by this rank contains",
                    item_identifier=ident,
                )
            owner = None if enc.replicated else enc.owner_rank
            if owner is not None and owner >= world:
                raise StepError(code.OUT_OF_RANGE, f"encoder_inputs[{ident[:16]}].owner_rank={owner}; the group has "
                                f"{world} ranks", item_identifier=ident)
            if owner is not None and owner != self.rank:  # another rank encodes it; its output comes over the group
                try:
                    feature = wire.feature_from_proto(msg)
                except (wire.WireError, ValueError) as exc:
                    raise StepError(code.BAD_TENSOR, f"encoder_inputs[{ident[:16]}]: {exc}", item_identifier=ident) from None
                encode.append((ident, feature, owner))
                encoded_after.add(ident)
                encoder_tokens += feature.mm_position.get_num_embeds()
                continue
            fields = dict(
                {} if reset or ident in gone_payloads else (self.payloads.get(ident) or {}), **incoming.get(ident, {})
            )
            if ident not in incoming and fields:
                plan_hits += 1
            try:
                feature = wire.feature_from_proto(msg, payload=fields)
            except (wire.WireError, ValueError) as exc:
                raise StepError(
                    code.BAD_TENSOR, f"encoder_inputs[{ident[:16]}]: {exc}", item_identifier=ident
                ) from None
            if feature.encoding is PayloadEncoding.ENCODED and self.images is None:
                raise StepError(code.BAD_TENSOR, f"encoder_inputs[{ident[:16]}] is an encoded image, but the handshake "
                                "allowed no image format", item_identifier=ident)
            missing = [n for n in encoder_fields(feature) if feature.data is None or n not in feature.data]
            if missing:
                raise StepError(
                    code.MISSING_PAYLOAD,
                    f"encoder_inputs[{ident[:16]}] needs field(s) {', '.join(missing)}, which this rank does not hold "
                    f"(payload cache has {len(self.payloads)} items; none arrived for this item this step)",
                    item_identifier=ident,
                )
            problem = r.encoder_input_problem(feature)
            if problem is not None:
                raise StepError(code.BAD_TENSOR, f"encoder_inputs[{ident[:16]}]: {problem}", item_identifier=ident)
            encode.append((ident, feature, owner))
            encoded_after.add(ident)
            encoder_tokens += feature.mm_position.get_num_embeds()
        if encoder_tokens > self.encoded.budget_tokens:
            raise StepError(
                code.OUT_OF_RANGE,
                f"encoder cache would hold {encoder_tokens} rows after this step, over the budget of "
                f"{self.encoded.budget_tokens} (--encoder-cache-tokens)",
            )
        scheduled = {ident for ident, _, _ in encode}
        encoder_hits = 0
        for state, start, end in windows:
            for index in state.overlapping(start, end):
                ident = state.features[index].identifier
                if ident not in encoded_after:
                    raise StepError(
                        code.MISSING_PAYLOAD,
                        f"request {state.request_id}: tokens [{start}, {end}) need the encoder output of item "
                        f"{ident[:16]} (placeholders [{state.features[index].mm_position.offset}, "
                        f"{state.features[index].mm_position.end})), which this rank neither holds nor is told to "
                        "compute in encoder_inputs",
                        state.request_id,
                        ident,
                    )
                encoder_hits += ident not in scheduled
        payload_bytes = self.payloads.bytes_after(gone_payloads, incoming, reset)
        if payload_bytes > self.payloads.budget_bytes:
            raise StepError(
                code.OUT_OF_RANGE,
                f"payload cache would hold {payload_bytes} bytes after this step, over the budget of "
                f"{self.payloads.budget_bytes} (--payload-cache-bytes)",
            )
        return _Plan(control, finished, new, running, incoming, encode, windows, plan_hits, encoder_hits)

    # --- phase 2: bookkeeping --------------------------------------------------------------------------------

    def _register(self, state: RequestState) -> None:
        for item in state.item_msgs:
            entry = self.items.get(item.identifier)
            if entry is None:
                self.items[ItemId(item.identifier)] = [item, 1]
                continue
            entry[1] += 1
            if wire.payload_field_headers(item):
                entry[0] = item  # prefer a message that announces the payload fields

    def _unregister(self, state: RequestState) -> None:
        for item in state.item_msgs:
            entry = self.items[item.identifier]
            entry[1] -= 1
            if entry[1] == 0:
                del self.items[item.identifier]

    def commit(self, plan: _Plan) -> None:
        control = plan.control
        self.last_step_id = control.step_id
        if control.reset_caches:
            self.payloads.clear()
            self.encoded.clear()
        self.payloads.evict(control.evict_payload_ids)
        self.encoded.evict(control.evict_encoder_ids)
        self.payloads.merge(plan.incoming)
        for rid in plan.finished:
            self._unregister(self.requests.pop(rid))
        for state in plan.new:
            self.requests[state.request_id] = state
            self._register(state)
        for state, delta in plan.running:
            state.token_ids.extend(delta.new_token_ids)
            state.num_output_tokens += len(delta.new_token_ids)
            state.block_ids.extend(delta.new_block_ids)
        if self.metrics is not None:
            self.metrics.cache_hits.labels(cache="payload").inc(plan.payload_hits)
            self.metrics.cache_hits.labels(cache="encoder").inc(plan.encoder_hits)

    # --- phase 3: compute ------------------------------------------------------------------------------------

    def _pixels(self, ident: ItemId, feature):
        """The feature with pixel fields: an encoded image decoded and preprocessed by the model's own processor
        (common/image_input.py); its grid must be the one the item carries (the prompt was built from it). Raises
        InvalidArgument for a file that fails (the item's failure, not the rank's)."""
        if feature.encoding is not PayloadEncoding.ENCODED:
            return feature
        data = feature.data[ENCODED_FIELD].data.numpy().tobytes()
        pixels, grid = self.images.process_bytes(data, f"item {ident[:16]}")
        want = feature.data["image_grid_thw"].data.reshape(1, 3)
        if not torch.equal(grid, want):
            raise InvalidArgument(f"item {ident[:16]}: the decoded image has the grid {grid.tolist()[0]}, its header "
                                  f"gave {want.tolist()[0]}")
        fields = {"pixel_values": MultiModalFieldElem(pixels), "image_grid_thw": feature.data["image_grid_thw"]}
        return dataclasses.replace(feature, data=MultiModalKwargsItem(fields), encoding=PayloadEncoding.PIXELS)

    def _encode_step(self, plan: _Plan, outcome: StepOutcome) -> set[ItemId]:
        """Runs the step's encoder work and fills the encoder cache; returns the items that failed (known to every
        rank alike). Each rank first encodes what it owns (every item under replicated placement); with several
        ranks they then exchange one status per item and each owner broadcasts its outputs, in control order."""
        r = self.runner
        t0 = time.perf_counter()
        rows_of: dict[ItemId, torch.Tensor] = {}
        failures: dict[ItemId, str] = {}
        for ident, feature, owner in plan.encode:
            if owner is not None and owner != self.rank:
                continue
            p0, encoded = time.perf_counter(), feature.encoding is PayloadEncoding.ENCODED
            try:
                feature = self._pixels(ident, feature)
            except InvalidArgument as exc:
                failures[ident] = exc.message
                continue
            finally:
                outcome.preprocess_seconds += (time.perf_counter() - p0) if encoded else 0.0
            rows = r.encode(feature)
            want = feature.mm_position.get_num_embeds()
            if rows.shape[0] != want:  # the item's failure, reported like a bad file: the peers must learn of it
                failures[ident] = (f"item {ident[:16]}: the encoder produced {rows.shape[0]} rows, its placeholder "
                                   f"range takes {want}")
                continue
            rows_of[ident] = rows if owner is None else rows.to(r.row_dtype)
            outcome.encoder_runs += 1
        outcome.encoder_seconds = time.perf_counter() - t0
        failed = set(failures)
        if self.group is not None and self.group.world_size > 1 and plan.encode:
            t1 = time.perf_counter()
            flags = self.group.any_failed([int(ident in failures) for ident, _, _ in plan.encode])
            failed = {ident for (ident, _, _), flag in zip(plan.encode, flags, strict=True) if flag}
            for ident, feature, owner in plan.encode:
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
            if plan.encode:
                m.encoder_seconds.observe(outcome.encoder_seconds)
            m.encoder_runs.inc(outcome.encoder_runs)
            m.image_failures.inc(len(failures))
            if outcome.preprocess_seconds:
                m.preprocess_seconds.observe(outcome.preprocess_seconds)
            if outcome.collective_seconds:
                m.encoder_collective_bytes.inc(outcome.collective_bytes)
                m.encoder_collective_seconds.observe(outcome.collective_seconds)
        return failed

    def execute(self, plan: _Plan) -> StepOutcome:
        r = self.runner
        outcome = StepOutcome([], 0.0, len(plan.encode))
        failed_items = self._encode_step(plan, outcome)
        windows = plan.windows
        if failed_items:  # every rank skips the same windows: those that reach an item no rank could encode
            windows = [(s, a, b) for s, a, b in windows
                       if not any(s.features[i].identifier in failed_items for i in s.overlapping(a, b))]

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
                    positions=state.window_positions(start, end),
                    mm_rows=mm_rows,
                    want_logits=end == len(state.token_ids),
                )
            )
        logits = r.forward(inputs)

        for (state, _start, end), row in zip(windows, logits, strict=True):
            state.num_computed = end
            full = end // r.block_size  # blocks now complete in the pool: a later request's prefix may read them
            self.written.update(state.block_ids[state.blocks_in_pool : full])
            state.blocks_in_pool = max(state.blocks_in_pool, full)
            if row is not None and self.rank == 0:
                drawn = self._sample(state, row)
                (outcome.sampled if isinstance(drawn, Sample) else outcome.failed).append((state.request_id, drawn))
        self._report_sizes()
        return outcome

    def _sample(self, state: RequestState, row: torch.Tensor) -> Sample | str:
        """The request's token, or why sampling it failed. Sampling runs after every collective of the step and
        only here on rank 0, so a failure is the request's alone: the group's state is intact (see worker.py)."""
        try:
            return sample(row, state.sampling, state.num_output_tokens)
        except Exception as exc:  # any failure of one request's draw or log-probabilities
            log.warning(
                "sampling failed; the request fails alone",
                extra={"request_id": state.request_id, "error": repr(exc)},
                exc_info=not isinstance(exc, SamplingError),
            )
            return f"sampling failed on rank {self.rank}: {exc}"

    def _report_sizes(self) -> None:
        if self.metrics is not None:
            self.metrics.set_cache_sizes(self.payloads.nbytes, len(self.payloads), self.encoded.tokens)
