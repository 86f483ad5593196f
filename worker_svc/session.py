"""The state of one scheduler stream on a rank, and how a step is applied to it.

A step runs in three phases:

1. ``plan``: checks the whole step against the state *as it will be* after this step's evictions, finishes,
   admissions and deltas — every request id, count, block id, token id, payload and encoder output the step needs
   — without changing anything. Every rank sees the same control bytes, so every rank reaches the same verdict, and
   a bad step fails on all ranks before any of them starts collective work.
2. ``commit``: applies evictions, received payloads, finishes, admissions and deltas (pure bookkeeping).
3. ``execute``: runs the vision encoder for the scheduled items, the language model for every scheduled window
   (gathering a request's prefix KV from the pool on its first forward), writes newly completed blocks into the
   pool, and samples on rank 0.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from common import wire
from common.ids import ItemId, RequestId
from mmcast.v1 import worker_pb2
from worker_svc.caches import EncoderCache, FrameError, PayloadAssembler, PayloadCache
from worker_svc.metrics import WorkerMetrics
from worker_svc.requests import RequestState, admit, check_blocks, check_prefix_written, check_tokens
from worker_svc.runner import ENCODER_FIELDS, ForwardInput
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
    encode: list[tuple[ItemId, object]]  # (identifier, feature with payload) to run through the encoder
    windows: list[tuple[RequestState, int, int]]  # (request, start, end) in control order
    payload_hits: int = 0
    encoder_hits: int = 0


@dataclasses.dataclass
class StepOutcome:
    sampled: list[tuple[RequestId, Sample]]  # rank 0: the token of every request the step sampled, except...
    encoder_seconds: float
    encoder_items: int
    failed: list[tuple[RequestId, str]] = dataclasses.field(default_factory=list)  # ...these: (id, why) (rank 0)


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
        batch_decode: bool = True,
    ) -> None:
        self.runner = runner
        self.rank = rank
        self.metrics = metrics
        self.batch_decode = batch_decode
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
            if end // r.block_size > num_blocks:
                raise StepError(
                    code.STATE_MISMATCH,
                    f"request {rid}: {end} computed tokens fill {end // r.block_size} blocks, the block table holds "
                    f"{num_blocks}",
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
        encode: list[tuple[ItemId, object]] = []
        plan_hits = 0
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
            missing = [n for n in ENCODER_FIELDS[feature.modality] if feature.data is None or n not in feature.data]
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
            encode.append((ident, feature))
            encoded_after.add(ident)
            encoder_tokens += feature.mm_position.get_num_embeds()
        if encoder_tokens > self.encoded.budget_tokens:
            raise StepError(
                code.OUT_OF_RANGE,
                f"encoder cache would hold {encoder_tokens} rows after this step, over the budget of "
                f"{self.encoded.budget_tokens} (--encoder-cache-tokens)",
            )
        scheduled = {ident for ident, _ in encode}
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

    def execute(self, plan: _Plan) -> StepOutcome:
        r = self.runner
        t0 = time.perf_counter()
        for ident, feature in plan.encode:
            rows = r.encode(feature)
            want = feature.mm_position.get_num_embeds()
            if rows.shape[0] != want:
                raise StepError(
                    code.STATE_MISMATCH,
                    f"item {ident[:16]}: the encoder produced {rows.shape[0]} rows, its placeholder range takes {want}",
                    item_identifier=ident,
                )
            self.encoded.put(ident, rows)
        encoder_seconds = time.perf_counter() - t0
        if plan.encode and self.metrics is not None:
            self.metrics.encoder_seconds.observe(encoder_seconds)

        inputs: list[ForwardInput] = []
        for state, start, end in plan.windows:
            if state.cache is None:
                state.cache = r.new_cache(state.block_ids, state.num_computed)
            mm_rows = []
            for index in state.overlapping(start, end):
                local, rows = state.item_rows(index, start, end)
                mm_rows.append((local, self.encoded.get(state.features[index].identifier)[rows]))
            inputs.append(
                ForwardInput(
                    cache=state.cache,
                    token_ids=state.token_ids[start:end],
                    positions=state.window_positions(start, end),
                    mm_rows=mm_rows,
                    want_logits=end == len(state.token_ids),
                )
            )
        logits = r.forward(inputs, batch_decode=self.batch_decode) if inputs else []

        sampled: list[tuple[RequestId, Sample]] = []
        failed: list[tuple[RequestId, str]] = []
        for (state, _start, end), row in zip(plan.windows, logits, strict=True):
            state.num_computed = end
            full = end // r.block_size
            r.write_blocks(state.cache, state.block_ids, state.blocks_in_pool, full)
            self.written.update(state.block_ids[state.blocks_in_pool : full])
            state.blocks_in_pool = max(state.blocks_in_pool, full)
            if row is not None and self.rank == 0:
                outcome = self._sample(state, row)
                (sampled if isinstance(outcome, Sample) else failed).append((state.request_id, outcome))
        self._report_sizes()
        return StepOutcome(sampled, encoder_seconds, len(plan.encode), failed)

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
