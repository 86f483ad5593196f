"""What the request path reads of one request in the engine: its token and finish events, its times and usage.

The engine (step_loop.py) owns the handles and fills them from the step loop; the request path (completion.py)
reads them on the same event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from common.errors import MmcastError
from common.ids import RequestId
from scheduler_svc.core.accounting_events import RequestUsage
from scheduler_svc.engine.stage_timing import RequestStages


@dataclasses.dataclass
class TokenEvent:
    token_ids: list[int]  # tokens delivered in this event, in order
    logprobs: list  # one (logprob, [(token_id, logprob), ...]) per token, or empty


@dataclasses.dataclass
class FinishEvent:
    reason: str  # "stop" | "length" | "cancelled" | "error"
    error: MmcastError | None = None  # set when reason == "error"


class RequestHandle:
    """What a client stream reads: token and finish events for one request."""

    def __init__(self, request_id: RequestId, received_at: float) -> None:
        self.request_id = request_id
        self.received_at = received_at
        self.first_scheduled_at: float | None = None  # when the first step that schedules it was planned
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None  # for the inter-token latency
        self.generated_tokens = 0  # tokens delivered to ``events``
        self.events: asyncio.Queue[TokenEvent | FinishEvent] = asyncio.Queue()
        self.usage = RequestUsage()  # the core's cumulative accounting, refreshed every step
        self.finished = False
        self.submitted_at = time.monotonic()  # queued in the engine: the queue stage starts here
        self.stages = RequestStages()  # its TTFT breakdown, filled by the door, the request path and the step loop
