"""What the service hands the scheduler core (the counterpart of step_plan.py): the group's budgets when it connects,
and each step's results as rank 0 and the owner ranks reported them — plain dataclasses, no protobuf. The shell
(step_loop.py, rank_streams.py) builds them from the handshakes and the ``StepResult`` messages.
"""

from __future__ import annotations

import dataclasses

from common.ids import ItemId, RequestId
from common.sample import Sample


@dataclasses.dataclass(frozen=True)
class GroupBudget:
    """What the worker group offers: the minimum over its ranks' handshakes (``rank_streams.WorkerGroup.connect``
    builds it; tests and benchmarks build it directly)."""

    num_ranks: int  # tensor-parallel ranks (payload mirrors and per-rank payload lists) (ranks)
    kv_blocks: int  # blocks in each rank's KV pool (blocks)
    encoder_cache_tokens: int  # encoder-output rows each rank holds; also the per-step encoder budget (rows)
    payload_cache_bytes: int  # payload bytes each rank holds (bytes)
    max_model_len: int = 0  # context length the ranks' model allows, 0 = not reported (tokens)
    max_tensor_bytes: int = 0  # largest single tensor every rank accepts, 0 = not reported (bytes)
    encoder_row_bytes: int = 0  # bytes of one encoder-output row: the collective's unit under sharded placement


@dataclasses.dataclass(frozen=True)
class GroupStepOutcome:
    """What a step's answers report back to ``Scheduler.update_from_output``."""

    sampled: dict[RequestId, Sample] = dataclasses.field(default_factory=dict)  # rank 0's token per sampling request
    failed: dict[RequestId, str] = dataclasses.field(default_factory=dict)  # requests rank 0 could not sample: why
    item_failures: dict[ItemId, str] = dataclasses.field(default_factory=dict)  # images an owner could not decode: why
    # The slowest rank's step time and vision-encoder time (WorkerStepStats), the stall bound's measurements
    # (step_costs.py); None: not measured (tests that leave the bound to its size budgets).
    step_seconds: float | None = None
    encoder_seconds: float = 0.0
