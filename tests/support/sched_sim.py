"""Test support for the scheduler core: request factories, a simulated rank group that replays every StepPlan
(through the serialized control, as the service sends it) and checks it, and a driver.

The simulated rank keeps what a real one keeps — payload cache, encoder cache, per-request state, a KV pool whose
blocks record the content written into them — and fails loudly on any violation of docs/ARCHITECTURE.md §3 invariant 2 (an
encoder input without its payload, a window without the encoder output of an item it covers), of the lazy rule (a
payload received and evicted, or left over, without ever being consumed; a payload sent to a rank that already
holds it), of the budgets, and of the step protocol (unknown requests, computed-token mismatches, prefix hits on
blocks whose content differs). Under sharded placement only an encoder input's owner needs its payload; every
rank then holds the output (the collective that shares it is the real ranks' business, tests/service/test_encoder_placement_e2e.py).
"""

from __future__ import annotations

import dataclasses
import zlib

import torch

from common.ids import ItemId, RequestId
from common.item_proto import feature_from_proto
from common.multimodal import (
    FieldKind,
    Modality,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PayloadState,
    PlaceholderRange,
)
from common.sample import Sample
from mmcast.v1 import multimodal_pb2, worker_pb2
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.inputs import GroupBudget, GroupStepOutcome
from scheduler_svc.core.request import Request, RequestSampling
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.transport.plan_proto import step_control

IMG = 1000  # placeholder token id
EOS = 1001
ROW_BYTES = 16  # payload bytes per placeholder token of a synthetic item (rows of 4 float32)


def outcome(sampled, failed=None) -> GroupStepOutcome:
    """A step's outcome from the tests' shorthand: request id -> token id or (token id, logprob, top_logprobs);
    ``failed``: request id -> message."""
    return GroupStepOutcome(
        {RequestId(r): Sample(*v) if isinstance(v, tuple) else Sample(v) for r, v in sampled.items()},
        {RequestId(r): m for r, m in (failed or {}).items()},
    )


class Violation(AssertionError):
    pass


def text(name: str, n: int) -> list[int]:
    """``n`` deterministic text tokens for segment ``name`` (ids below the special ones)."""
    base = zlib.crc32(name.encode())
    return [(base + 37 * i) % 900 + 1 for i in range(n)]


def feature(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    """A synthetic image item: ``length`` placeholder tokens, pixel rows of 16 bytes each, an M-RoPE grid."""
    data = MultiModalKwargsItem(
        {
            "pixel_values": MultiModalFieldElem(torch.zeros(length, 4), keep_on_cpu=False, kind=FieldKind.FLAT),
            "image_grid_thw": MultiModalFieldElem(torch.tensor([[1, 2, length // 2]]), keep_on_cpu=True),
        }
    )
    return MultiModalFeatureSpec(
        data, Modality.IMAGE, ItemId(identifier), PlaceholderRange(offset, length), payload_nbytes=length * ROW_BYTES
    )


def build(segments) -> tuple[list[int], list[MultiModalFeatureSpec]]:
    """Segments: ``list[int]`` (tokens) or ``(identifier, length)`` (an image)."""
    tokens: list[int] = []
    features = []
    for seg in segments:
        if isinstance(seg, tuple):
            identifier, length = seg
            features.append(feature(identifier, len(tokens), length))
            tokens += [IMG] * length
        else:
            tokens += list(seg)
    return tokens, features


def request(rid: str, segments, *, max_tokens: int = 4, salt: str | None = None) -> Request:
    tokens, features = build(segments)
    return Request(rid, tokens, features, RequestSampling(max_tokens=max_tokens, ignore_eos=True), cache_salt=salt)


def sample_token(rid: str, position: int) -> int:
    """Rank 0's 'model': a token that depends only on the request and the position (so recompute repeats it)."""
    return zlib.crc32(f"{rid}:{position}".encode()) % 900 + 1


@dataclasses.dataclass
class SimRequest:
    tokens: list[int]
    items: list[MultiModalFeatureSpec]
    blocks: list[int]
    num_computed: int
    salt: str | None


class SimRank:
    def __init__(
        self,
        rank: int,
        mode: str,
        payload_budget: int,
        encoder_budget: int,
        block_size: int,
        salts: dict[str, str | None],
        sharded: bool = False,
    ) -> None:
        self.rank, self.mode, self.bs, self.sharded = rank, mode, block_size, sharded
        self.payload_budget, self.encoder_budget = payload_budget, encoder_budget
        self.payloads: dict[str, int] = {}  # id -> bytes
        self.consumed: dict[str, bool] = {}  # lazy: whether a held payload fed an encoder input since it arrived
        self.encoder: dict[str, int] = {}  # id -> rows
        self.reqs: dict[str, SimRequest] = {}
        self.pool: dict[int, tuple] = {}  # block id -> content written
        self.salts = salts
        self.received_ids: list[str] = []

    def _content(self, req: SimRequest, b: int) -> tuple:
        start, end = b * self.bs, (b + 1) * self.bs
        keys = tuple(
            (f.identifier, f.mm_position.offset - start)
            for f in req.items
            if f.mm_position.offset < end and start < f.mm_position.end
        )
        return tuple(req.tokens[start:end]), keys, (req.salt if b == 0 else None)

    def apply(self, control_bytes: bytes, sends) -> int | None:
        ctrl = worker_pb2.StepControl.FromString(control_bytes)
        where = f"rank {self.rank} step {ctrl.step_id}"
        staged = {}
        for s in sends:
            if s.identifier in staged:
                raise Violation(f"{where}: payload {s.identifier} sent twice in one step")
            staged[s.identifier] = s.nbytes
        if ctrl.reset_caches:
            self.payloads.clear()
            self.encoder.clear()
            self.consumed.clear()
        for rid in ctrl.finished_request_ids:
            if self.reqs.pop(rid, None) is None:
                raise Violation(f"{where}: finished {rid} is unknown")
        for key in ctrl.evict_payload_ids:
            if key in staged:
                raise Violation(f"{where}: payload {key} evicted in the step that sends it")
            if key not in self.payloads:
                if self.sharded:
                    continue  # the list is the group's: under sharded placement another rank held it
                raise Violation(f"{where}: evicts payload {key} it does not hold")
            if self.mode == "lazy" and not self.consumed[key]:
                raise Violation(f"{where}: lazy payload {key} evicted without ever being consumed")
            del self.payloads[key]
        for key, nbytes in staged.items():
            if self.mode == "lazy" and key in self.payloads:
                raise Violation(f"{where}: lazy sent payload {key} the rank already holds")
            self.payloads[key] = nbytes
            self.consumed[key] = False
            self.received_ids.append(key)
        if sum(self.payloads.values()) > self.payload_budget:
            raise Violation(f"{where}: payload cache {sum(self.payloads.values())} > budget {self.payload_budget}")
        for key in ctrl.evict_encoder_ids:
            if self.encoder.pop(key, None) is None:
                raise Violation(f"{where}: evicts encoder output {key} it does not hold")

        windows = []
        for nr in ctrl.new_requests:
            if nr.request_id in self.reqs:
                raise Violation(f"{where}: new request {nr.request_id} already held")
            items = [feature_from_proto(m) for m in nr.mm_items]
            req = SimRequest(
                list(nr.prompt_token_ids),
                items,
                list(nr.block_ids),
                nr.num_computed_tokens,
                self.salts.get(nr.request_id),
            )
            self._check_items(where, nr, items)
            if nr.num_computed_tokens % self.bs:
                raise Violation(f"{where}: {nr.request_id} prefix {nr.num_computed_tokens} not block aligned")
            for b in range(nr.num_computed_tokens // self.bs):
                if self.pool.get(req.blocks[b]) != self._content(req, b):
                    raise Violation(f"{where}: {nr.request_id} hits block {req.blocks[b]} whose content differs")
            self.reqs[nr.request_id] = req
            windows.append((nr.request_id, nr.num_computed_tokens, nr.num_scheduled_tokens))
        for rr in ctrl.running:
            req = self.reqs.get(rr.request_id)
            if req is None:
                raise Violation(f"{where}: running {rr.request_id} is unknown")
            req.tokens += rr.new_token_ids
            req.blocks += rr.new_block_ids
            if rr.num_computed_tokens != req.num_computed:
                raise Violation(f"{where}: {rr.request_id} computed {rr.num_computed_tokens} != {req.num_computed}")
            windows.append((rr.request_id, rr.num_computed_tokens, rr.num_scheduled_tokens))

        rows = {f.identifier: f.mm_position.length for r in self.reqs.values() for f in r.items}
        for enc in ctrl.encoder_inputs:
            key = enc.item_identifier
            if enc.replicated == self.sharded:
                raise Violation(
                    f"{where}: encoder input {key} replicated={enc.replicated} under sharded={self.sharded}"
                )
            if enc.replicated or enc.owner_rank == self.rank:
                if key not in self.payloads:
                    raise Violation(f"{where}: encoder input {key} but the payload is missing (MISSING_PAYLOAD)")
                self.consumed[key] = True
            self.encoder[key] = rows[key]  # sharded: the owner's output, shared on the collective
        if sum(self.encoder.values()) > self.encoder_budget:
            raise Violation(f"{where}: encoder cache {sum(self.encoder.values())} > budget {self.encoder_budget}")

        sampled = {}
        for rid, start, n in windows:
            req = self.reqs[rid]
            if n < 1 or start + n > len(req.tokens) or len(req.blocks) * self.bs < start + n:
                raise Violation(
                    f"{where}: {rid} window [{start}, {start + n}) vs {len(req.tokens)} tokens, "
                    f"{len(req.blocks)} blocks"
                )
            for f in req.items:
                if f.overlaps(start, start + n) and f.identifier not in self.encoder:
                    raise Violation(
                        f"{where}: {rid} computes [{start}, {start + n}) without the encoder output of {f.identifier}"
                    )
            for b in range(start // self.bs, (start + n) // self.bs):
                self.pool[req.blocks[b]] = self._content(req, b)
            req.num_computed = start + n
            if req.num_computed == len(req.tokens):
                sampled[rid] = sample_token(rid, len(req.tokens))
        return sampled

    def _check_items(self, where: str, nr, items) -> None:
        uncovered = {f.identifier: f.payload_nbytes for f in items if not f.covered_by(nr.num_computed_tokens)}
        strip_defers = sum(uncovered.values()) > self.payload_budget  # strip's guarantee (transfer.py's doc)
        for msg, f in zip(nr.mm_items, items, strict=True):
            covered = f.covered_by(nr.num_computed_tokens)
            state = f.payload_state
            if self.mode == "full":
                ok = state is PayloadState.PRESENT
            elif covered:
                ok = state is PayloadState.STRIPPED and [x.name for x in msg.fields] == ["image_grid_thw"]
            else:
                present = self.mode == "strip" and not strip_defers
                ok = state is (PayloadState.PRESENT if present else PayloadState.DEFERRED)
            if not ok:
                raise Violation(f"{where}: {nr.request_id} item {f.identifier} covered={covered} has state {state}")
            if state is PayloadState.PRESENT and not self.sharded and f.identifier not in self.payloads:
                raise Violation(f"{where}: {nr.request_id} item {f.identifier} PRESENT but not received")
            if msg.payload_state == multimodal_pb2.PAYLOAD_STATE_UNSPECIFIED:
                raise Violation(f"{where}: unspecified payload state")

    def check_end(self) -> None:
        if self.mode == "lazy":
            unused = [k for k, used in self.consumed.items() if not used and k in self.payloads]
            if unused:
                raise Violation(f"rank {self.rank}: lazy payloads {unused} were never consumed")


@dataclasses.dataclass
class StepRecord:
    step_id: int
    sends: dict[int, list[str]]  # rank -> payload ids in send order
    encoder_inputs: list[str]
    new_requests: dict[str, int]  # request id -> num_computed_tokens at (re)admission
    scheduled: dict[str, int]
    preempted: list[str]
    evict_payload_ids: list[str]
    evict_encoder_ids: list[str]
    items_examined: int
    plan: object = dataclasses.field(repr=False, default=None)


class Harness:
    """A scheduler wired to simulated ranks; ``run`` drives steps until idle."""

    def __init__(
        self,
        mode: str,
        *,
        num_ranks: int = 2,
        kv_blocks: int = 256,
        encoder_tokens: int = 4096,
        payload_bytes: int = 1 << 20,
        block_size: int = 16,
        max_batched: int = 8192,
        max_seqs: int = 64,
        max_model_len: int = 65536,
        keep_plans: bool = False,
        placement: str = "replicated",
        kv_events=None,
        step_encoder: int | None = None,
        max_stall_ms: float = 0.0,
        timing=None,
    ) -> None:
        self.mode = mode
        self.sharded = placement == "sharded"
        self.config = SchedulerConfig(
            transfer_mode=mode,
            block_size=block_size,
            max_num_batched_tokens=max_batched,
            max_num_seqs=max_seqs,
            max_model_len=max_model_len,
            encoder_placement=placement,
            **({} if step_encoder is None else {"max_num_encoder_tokens": step_encoder}),
            max_decode_stall_ms=max_stall_ms,
        )
        # plan -> (step seconds, encoder seconds) the ranks report; None: no times (no stall bound)
        self.timing = timing
        self.group = GroupBudget(num_ranks, kv_blocks, encoder_tokens, payload_bytes)
        self.sched = Scheduler(self.config, self.group, uses_mrope=True, eos_token_ids={EOS}, kv_events=kv_events)
        self.salts: dict[str, str | None] = {}
        self.log: list[StepRecord] = []
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}
        self.keep_plans = keep_plans
        self.max_tokens: dict[str, int] = {}
        self.recoveries = 0
        self._new_ranks()

    def _new_ranks(self) -> None:
        g = self.group
        self.ranks = [
            SimRank(
                r,
                self.mode,
                g.payload_cache_bytes,
                g.encoder_cache_tokens,
                self.config.block_size,
                self.salts,
                self.sharded,
            )
            for r in range(g.num_ranks)
        ]

    def add(self, req: Request) -> Request:
        self.salts[req.request_id] = req.cache_salt
        self.sched.add_request(req)
        self.outputs.setdefault(req.request_id, [])
        self.max_tokens[req.request_id] = req.sampling.max_tokens
        return req

    def step(self) -> StepRecord | None:
        plan = self.sched.schedule()
        if plan is None:
            return None
        return self.apply(plan)

    def apply(self, plan) -> StepRecord:
        """Runs a scheduled plan on the simulated ranks and feeds rank 0's tokens back to the core."""
        control = step_control(plan).SerializeToString()  # once, like the service
        totals, sends = plan.totals(), [s for per_rank in plan.rank_payloads for s in per_rank]
        if (totals.sent, totals.payload_bytes_sent) != (len(sends), sum(s.nbytes for s in sends)):
            raise Violation(
                f"step {plan.step_id}: counted {totals.sent} deliveries / {totals.payload_bytes_sent} "
                f"bytes, queued {len(sends)} / {sum(s.nbytes for s in sends)}"
            )
        sampled = {}
        for rank in self.ranks:
            got = rank.apply(control, plan.rank_payloads[rank.rank])
            if rank.rank == 0:
                sampled = got
        if sorted(sampled) != sorted(plan.sampling_request_ids):
            raise Violation(
                f"step {plan.step_id}: rank 0 sampled {sorted(sampled)}, plan says {sorted(plan.sampling_request_ids)}"
            )
        result = outcome(sampled)
        if self.timing is not None:  # the ranks' clocks, as a cost model of the plan says (the stall bound's input)
            step_seconds, encoder_seconds = self.timing(plan)
            result = dataclasses.replace(result, step_seconds=step_seconds, encoder_seconds=encoder_seconds)
        for update in self.sched.update_from_output(plan, result):
            self.outputs[update.request_id] += update.new_token_ids
            if update.finished is not None:
                self.finished[update.request_id] = update
        rec = StepRecord(
            plan.step_id,
            {r: [s.identifier for s in p] for r, p in enumerate(plan.rank_payloads)},
            list(plan.encoder_inputs),
            {n.request_id: n.num_computed_tokens for n in plan.new_requests},
            dict(plan.num_scheduled_tokens),
            list(plan.preempted_request_ids),
            list(plan.evict_payload_ids),
            list(plan.evict_encoder_ids),
            plan.items_examined,
            plan if self.keep_plans else None,
        )
        self.log.append(rec)
        return rec

    def run(self, max_steps: int = 10_000) -> list[StepRecord]:
        first = len(self.log)
        for _ in range(max_steps):
            if self.step() is None:
                break
        else:
            raise Violation(f"not idle after {max_steps} steps")
        for rank in self.ranks:
            rank.check_end()
        return self.log[first:]

    def lose_group(self) -> None:
        """The group died mid-generation and came back empty."""
        self.sched.recover()
        self.recoveries += 1
        self._new_ranks()
        assert self.sched.reset_group(self.group) == []

    def sends(self, records) -> list[dict[int, list[str]]]:
        return [r.sends for r in records]

    def all_sent(self, records, rank: int = 0) -> list[str]:
        return [key for r in records for key in r.sends[rank]]
