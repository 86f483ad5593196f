"""Everything the scheduler core hands to the service: one ``StepPlan`` per step and ``RequestUpdate``s after it.

The plain dataclasses here mirror ``mmcast.v1.worker_pb2.StepControl`` field for field; ``scheduler_svc.transport.plan_proto``
converts them once per step into the control message, whose bytes are identical for every rank. Payload frames
are per rank (``StepPlan.rank_payloads``) and must precede the control on that rank's stream.

Caching contract (what the ranks keep between steps, so the plan only carries deltas):
- a rank holds every running request's tokens, block table and computed-token count; ``RunningRequestData``
  carries only what changed;
- a rank holds every payload it received until a control lists its identifier in ``evict_payload_ids``, and every
  encoder output until ``evict_encoder_ids`` lists it (or ``reset_caches`` is set). The scheduler mirrors both
  caches and never evicts anything a step still needs.
"""

from __future__ import annotations

import dataclasses

from common.errors import Status
from common.ids import ItemId, RequestId
from common.multimodal import MultiModalFeatureSpec
from scheduler_svc.core.accounting_events import ItemAccounting, RequestUsage
from scheduler_svc.core.request import FinishReason, Request, RequestSampling


def payload_nbytes(feature: MultiModalFeatureSpec) -> int:
    """Bytes of an item's heavy fields (those ``full`` would send)."""
    if feature.payload_nbytes:
        return feature.payload_nbytes
    return feature.data.payload_nbytes() if feature.data is not None else 0


@dataclasses.dataclass(frozen=True)
class PayloadSend:
    """One item whose payload frames go to a rank before this step's control."""

    identifier: ItemId  # PayloadFrame.item_identifier of every frame of the item
    feature: MultiModalFeatureSpec  # the scheduler's full feature: its non-keep_on_cpu fields are the payload
    request_id: RequestId  # the request the payload is sent for (per-request byte accounting)

    @property
    def nbytes(self) -> int:
        """Payload tensor bytes (frame overhead excluded)."""
        return payload_nbytes(self.feature)


@dataclasses.dataclass
class NewRequestData:
    """A request the ranks do not hold yet: first admission, or resumption after preemption or recovery."""

    request_id: RequestId  # the request's id, unique among in-flight requests
    prompt_token_ids: list[int]  # the whole known sequence: prompt + tokens generated so far
    mm_items: list[MultiModalFeatureSpec]  # wire copies, ordered by position, payload_state set for the ranks
    sampling: RequestSampling  # what the ranks need to sample its tokens
    block_ids: list[int]  # the request's whole block table (prefix hits first)
    num_computed_tokens: int  # prefix-hit tokens, block aligned; the ranks gather their KV on admission
    num_scheduled_tokens: int  # tokens to compute this step, from num_computed_tokens on
    num_output_tokens: int  # of prompt_token_ids, how many were generated (seeds the sampling index)
    live: LiveContext | None = None  # a live session's turn: where its positions start, its KV moves


@dataclasses.dataclass(frozen=True)
class LiveContext:
    """What the ranks need of a live session's turn (``scheduler_svc/core/live_sessions.py``)."""

    position_offset: int  # the position of the turn's first computed token (its text row)
    kv_moves: tuple[tuple[int, int, int], ...] = ()  # (src, dst, count) in the request's own token indices


@dataclasses.dataclass
class RunningRequestData:
    """Delta of a request the ranks already hold."""

    request_id: RequestId  # a request the ranks hold
    new_token_ids: list[int]  # tokens sampled since the ranks were last told (rank 0 knows them; others not)
    new_block_ids: list[int]  # blocks appended to the table this step
    num_computed_tokens: int  # tokens computed before this step; equals the rank's own count
    num_scheduled_tokens: int  # tokens to compute this step
    # Async scheduling: the step's input is the token the ranks sampled for it last step (new_token_ids empty).
    input_is_last_sampled: bool = False


@dataclasses.dataclass(frozen=True)
class StepWork:
    """What a step computes beside its decodes, the work the stall bound prices (``step_costs.py``)."""

    prefill_tokens: int = 0  # tokens of windows other than one decode token (tokens)
    encoder_rows: int = 0  # encoder-output rows the step encodes (rows)


@dataclasses.dataclass
class StepPlan:
    """One step for the whole group. Send ``rank_payloads[r]`` frames then the control (``plan_proto.step_control``)
    to rank r, for every r; wait for every rank's StepResult; pass their results to ``Scheduler.update_from_output``
    as an ``inputs.GroupStepOutcome``."""

    step_id: int  # strictly increasing, never reused (also across recoveries)
    new_requests: list[NewRequestData]  # admitted or resumed this step, in admission order
    running: list[RunningRequestData]  # deltas of scheduled requests the ranks already hold
    finished_request_ids: list[RequestId]  # ranks drop their state: finished, cancelled or preempted (requeued)
    preempted_request_ids: list[RequestId]  # the subset of finished_request_ids preempted by this step
    encoder_inputs: list[ItemId]  # items to encode this step; every rank holds each output afterwards
    encoder_owners: list[int | None]  # per encoder input: the rank that encodes it (sharded), None = every rank
    evict_payload_ids: list[ItemId]  # every rank drops these payloads (none is used or sent this step)
    evict_encoder_ids: list[ItemId]  # every rank drops these encoder outputs (none is used this step)
    reset_caches: bool  # first step after a recovery: ranks drop every payload and encoder output first
    num_scheduled_tokens: dict[RequestId, int]  # request -> tokens computed this step; sum <= max_num_batched_tokens
    sampling_request_ids: list[RequestId]  # requests whose scheduled tokens reach their end: rank 0 samples one each
    rank_payloads: list[list[PayloadSend]]  # per rank: items whose payload frames precede the control (each id once)
    accounting: dict[RequestId, ItemAccounting]  # per-request item/byte increments decided by this step
    items_examined: int  # items the step builder looked at: window overlaps + items of admitted requests
    scheduled: list[tuple[Request, int]] = dataclasses.field(default_factory=list, repr=False)  # core bookkeeping
    # What requests that ended since the previous plan left (abandoned deliveries): already in their Usage, so
    # only the metrics add it (``totals``).
    released: ItemAccounting = dataclasses.field(default_factory=ItemAccounting)
    # The video items' share of ``totals`` (the metrics' modality label; the rest is images).
    video_totals: ItemAccounting = dataclasses.field(default_factory=ItemAccounting)
    # Structured output: request -> its allowed tokens (TokenMask.allowed); only requests in sampling_request_ids.
    token_masks: dict[RequestId, bytes] = dataclasses.field(default_factory=dict)
    # A step planned ahead (async scheduling): requests of sampling_request_ids whose masks need the previous step's
    # tokens, sent once that step is applied (``Scheduler.late_masks``, the wire's LateTokenMasks).
    masks_follow: list[RequestId] = dataclasses.field(default_factory=list)
    work: StepWork = StepWork()  # its prefill and encoder work, priced by the outcome's times (step_costs.py)
    stall_bounded: bool = False  # --max-decode-stall-ms cut a prefill window of this step (a metric counts them)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    def totals(self) -> ItemAccounting:
        """Accounting summed over requests (what the metrics add)."""
        return ItemAccounting.total([*self.accounting.values(), self.released])


@dataclasses.dataclass
class RequestUpdate:
    """What a step (or a service-side stop) changed for one request."""

    request_id: RequestId  # the request it is about
    new_token_ids: list[int]  # tokens generated by this step, in order (at most one per step)
    logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None  # per new token (logprob,
    # [(token id, logprob), ...] alternatives; natural logs) when the request asked for them
    finished: FinishReason | None = None  # set when the request ended; the scheduler holds nothing of it any more
    stop_token_id: int | None = None  # the EOS/stop token that ended it (it is included in new_token_ids)
    usage: RequestUsage | None = None  # cumulative accounting; set when finished
    error: str | None = None  # why it failed (finished == ERROR), naming the limit
    error_status: Status | None = None  # the client's status for `error`; None = UNAVAILABLE (the group is down)
    error_field: str | None = None  # the request field `error` is about (an image's path), for BadRequest
