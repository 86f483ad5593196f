"""Step plan -> protobuf: the one ``StepControl`` every rank receives.

The control is built once per step; the service serializes it once and writes the same bytes to each rank. The
payload frames of an item are built once per step too, by the rank streams (``rank_streams.py``), and written to
every rank whose ``StepPlan.rank_payloads`` lists the item.
"""

from __future__ import annotations

from common import penalties
from common.item_proto import feature_to_proto
from mmcast.v1 import worker_pb2
from scheduler_svc.request import SamplingParams
from scheduler_svc.step_plan import NewRequestData, RunningRequestData


def sampling_to_proto(sampling: SamplingParams) -> worker_pb2.WorkerSampling:
    msg = worker_pb2.WorkerSampling(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sampling.seed,
        logprobs=sampling.logprobs,
        return_logprobs=sampling.return_logprobs,
    )
    if sampling.penalties.active:
        penalties.to_worker(sampling.penalties, msg)
    return msg


def new_request_to_proto(data: NewRequestData) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        request_id=data.request_id,
        prompt_token_ids=data.prompt_token_ids,
        mm_items=[feature_to_proto(f) for f in data.mm_items],
        sampling=sampling_to_proto(data.sampling),
        block_ids=data.block_ids,
        num_computed_tokens=data.num_computed_tokens,
        num_scheduled_tokens=data.num_scheduled_tokens,
        num_output_tokens=data.num_output_tokens,
        live=None
        if data.live is None
        else worker_pb2.LiveContext(
            positions_from=data.num_computed_tokens,
            position_offset=data.live.position_offset,
            kv_moves=[worker_pb2.KvMove(src=a, dst=b, count=c) for a, b, c in data.live.kv_moves],
        ),
    )


def running_request_to_proto(data: RunningRequestData) -> worker_pb2.RunningRequest:
    return worker_pb2.RunningRequest(
        request_id=data.request_id,
        new_token_ids=data.new_token_ids,
        new_block_ids=data.new_block_ids,
        num_computed_tokens=data.num_computed_tokens,
        num_scheduled_tokens=data.num_scheduled_tokens,
    )


def step_control(plan) -> worker_pb2.StepControl:
    """The control message of a ``StepPlan`` (identical for every rank)."""
    return worker_pb2.StepControl(
        step_id=plan.step_id,
        new_requests=[new_request_to_proto(n) for n in plan.new_requests],
        running=[running_request_to_proto(r) for r in plan.running],
        finished_request_ids=plan.finished_request_ids,
        encoder_inputs=[
            worker_pb2.EncoderInput(item_identifier=i, owner_rank=owner or 0, replicated=owner is None)
            for i, owner in zip(plan.encoder_inputs, plan.encoder_owners, strict=True)
        ],
        evict_payload_ids=plan.evict_payload_ids,
        evict_encoder_ids=plan.evict_encoder_ids,
        reset_caches=plan.reset_caches,
        token_masks=[worker_pb2.TokenMask(request_id=rid, allowed=mask) for rid, mask in plan.token_masks.items()],
    )
