"""Rank 0's late token masks: a step announced in ``StepControl.masks_follow`` (docs/ARCHITECTURE.md §2.12).

Under async scheduling the scheduler writes step k+1 before it knows step k's tokens. A constrained request's mask for
k+1 depends on its token of step k, so k+1's control only names the request in ``masks_follow``, and the masks come
once the scheduler has applied step k's answer: in k+2's control (``prior_masks``), or in a ``LateTokenMasks`` frame
when no k+2 is planned yet.

Rank 0 runs k+1's forward and returns without sampling (``session.SamplesAwaitMasks``). The event loop then reads
the frame carrying the masks (it is usually there already; a control read so is applied after k+1's answer), checks
it here (``LateMasks.take``) and has the step sampled (``Worker.finish_step``) before writing the answer: on its own
thread when the rank has one intra-op thread, so a constrained step costs no more hand-overs between threads than an
unconstrained one; else on the compute thread (one more hand-over each way), which keeps a rank's torch work on one
OpenMP team (``worker_svc/inline_steps.py`` says why). Handing the masks to a compute thread waiting for them took two
more wake-ups (~0.1 ms apiece on a 2-vCPU VM), and reading the frame during the forward made the two threads take
turns at the interpreter lock through it (docs/ARCHITECTURE.md §2.12 has both measurements).

The read is bounded by the rank's ``--late-mask-timeout-seconds``: past it the step fails as a protocol error naming
the flag, so a rank never waits forever for a scheduler that stopped sending (the scheduler's own step deadline
recovers the group meanwhile); a stream that ends or is superseded ends the wait at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from common.ids import RequestId
from mmcast.v1 import worker_pb2
from worker_svc.step_errors import StepError, code
from worker_svc.token_mask import check_late_masks


@dataclasses.dataclass(frozen=True)
class LateMasks:
    """What the late masks of one step are checked against, and how long the rank waits for them."""

    step_id: int
    announced: frozenset[RequestId]
    vocab_size: int
    timeout: float  # seconds (--late-mask-timeout-seconds)

    @classmethod
    def of(cls, step_id: int, announced: Iterable[str], vocab_size: int, timeout: float) -> LateMasks:
        return cls(step_id, frozenset(RequestId(r) for r in announced), vocab_size, timeout)

    @property
    def waiting(self) -> str:
        """The wait, as the refusals name it."""
        return f"step {self.step_id} waits for its late token masks (StepControl.masks_follow)"

    def take(self, frame: worker_pb2.LateTokenMasks) -> dict[RequestId, worker_pb2.TokenMask]:
        """The masks of ``frame`` (request -> TokenMask; an announced request without one ended in the previous
        step and draws unmasked), checked against the step (``check_late_masks``). Raises ``StepError``."""
        return check_late_masks(frame, self.step_id, self.announced, self.vocab_size)

    def timed_out(self) -> StepError:
        return StepError(
            code.STATE_MISMATCH,
            f"step {self.step_id}: the late token masks its control announced (masks_follow: "
            f"{len(self.announced)} requests) did not come within {self.timeout:g} s (--late-mask-timeout-seconds)",
        )
