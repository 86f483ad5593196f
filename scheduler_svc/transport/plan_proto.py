"""Step plan -> protobuf: the one ``StepControl`` every rank receives.

The control is built once per step; the service serializes it once and writes the same bytes to each rank. The
payload frames of an item are built once per step too, by the rank streams (``rank_streams.py``), and written to
every rank whose ``StepPlan.rank_payloads`` lists the item.
"""

from __future__ import annotations

from common import penalties
from common.item_proto import feature_to_proto
from mmcast.v1 import worker_pb2
from scheduler_svc.core.request import RequestSampling
from scheduler_svc.core.step_plan import NewRequestData, RunningRequestData

# The fields each message takes unchanged from the attribute of the same name; the others are built below.
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "logprobs", "return_logprobs")
_COUNTS = ("num_computed_tokens", "num_scheduled_tokens")  # both request messages carry them
_NEW_REQUEST_FIELDS = ("request_id", "prompt_token_ids", "block_ids", *_COUNTS, "num_output_tokens")
_RUNNING_FIELDS = ("request_id", "new_token_ids", "new_block_ids", *_COUNTS, "input_is_last_sampled")
_STEP_FIELDS = (
    "step_id",
    "finished_request_ids",
    "evict_payload_ids",
    "evict_encoder_ids",
    "reset_caches",
    "masks_follow",
)


def _same_named(source, fields: tuple[str, ...]) -> dict:
    return {name: getattr(source, name) for name in fields}


def sampling_to_proto(sampling: RequestSampling) -> worker_pb2.WorkerSampling:
    msg = worker_pb2.WorkerSampling(**_same_named(sampling, _SAMPLING_FIELDS))
    if sampling.penalties.active:
        penalties.to_worker(sampling.penalties, msg)
    return msg


def new_request_to_proto(data: NewRequestData) -> worker_pb2.NewRequest:
    return worker_pb2.NewRequest(
        **_same_named(data, _NEW_REQUEST_FIELDS),
        mm_items=[feature_to_proto(f) for f in data.mm_items],
        sampling=sampling_to_proto(data.sampling),
        live=None
        if data.live is None
        else worker_pb2.LiveContext(
            positions_from=data.num_computed_tokens,
            position_offset=data.live.position_offset,
            kv_moves=[worker_pb2.KvMove(src=a, dst=b, count=c) for a, b, c in data.live.kv_moves],
        ),
    )


def running_request_to_proto(data: RunningRequestData) -> worker_pb2.RunningRequest:
    return worker_pb2.RunningRequest(**_same_named(data, _RUNNING_FIELDS))


def late_masks_proto(step_id: int, masks: dict[str, bytes]) -> worker_pb2.LateTokenMasks:
    """The late masks of step ``step_id`` (``Scheduler.late_masks``): a frame of their own, or the next control's
    ``prior_masks``."""
    return worker_pb2.LateTokenMasks(
        step_id=step_id, masks=[worker_pb2.TokenMask(request_id=rid, allowed=m) for rid, m in masks.items()]
    )


def step_control(plan, prior_masks: worker_pb2.LateTokenMasks | None = None) -> worker_pb2.StepControl:
    """The control message of a ``StepPlan`` (identical for every rank); ``prior_masks``: the late masks of the step
    in flight before it, which rank 0 takes from this control."""
    return worker_pb2.StepControl(
        prior_masks=prior_masks,
        **_same_named(plan, _STEP_FIELDS),
        new_requests=[new_request_to_proto(n) for n in plan.new_requests],
        running=[running_request_to_proto(r) for r in plan.running],
        encoder_inputs=[
            worker_pb2.EncoderInput(item_identifier=i, owner_rank=owner or 0, replicated=owner is None)
            for i, owner in zip(plan.encoder_inputs, plan.encoder_owners, strict=True)
        ],
        token_masks=[worker_pb2.TokenMask(request_id=rid, allowed=mask) for rid, mask in plan.token_masks.items()],
    )
