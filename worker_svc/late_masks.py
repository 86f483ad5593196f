"""Rank 0's wait for the token masks a step announced in ``StepControl.masks_follow`` (docs/ARCHITECTURE.md §2.12).

Under async scheduling the scheduler writes step k+1 before it knows step k's tokens. A constrained request's mask for
k+1 depends on its token of step k, so k+1's control only names the request in ``masks_follow``, and the masks come
once the scheduler has applied step k's answer: in k+2's control (``prior_masks``), or in a ``LateTokenMasks`` frame
when no k+2 is planned yet. Rank 0's compute thread runs k+1's forward, then asks for the masks just before it
samples (``when_wanted``): only then does the event loop read that frame (a control read so is applied after k+1's
answer), so the two threads do not take turns at the interpreter lock through the forward.

``LateMasks`` is the hand-off between the two threads: the event loop delivers the checked masks (or a refusal), the
compute thread waits for them with a bound, the rank's ``--late-mask-timeout-seconds``. Past it the step fails as a
protocol error naming the flag, so a rank never waits forever for a scheduler that stopped sending (the scheduler's
own step deadline recovers the group meanwhile); a stream that ends or is superseded settles the wait at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from common.ids import RequestId
from mmcast.v1 import worker_pb2
from worker_svc.step_errors import StepError, code
from worker_svc.token_mask import check_late_masks


class LateMasks:
    """The late masks of one step: delivered once (masks or an error) by the event loop, awaited by the compute
    thread. Thread-safe."""

    def __init__(self, step_id: int, announced: Iterable[str], vocab_size: int) -> None:
        self.step_id = step_id
        self.announced = frozenset(RequestId(r) for r in announced)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._masks: dict[RequestId, worker_pb2.TokenMask] = {}
        self._error: StepError | None = None
        self._wanted = None  # called (once) when the compute thread first waits: the event loop starts reading

    def when_wanted(self, callback) -> None:
        """``callback()`` (thread-safe, from the compute thread) when the step first needs its masks."""
        self._wanted = callback

    @property
    def settled(self) -> bool:
        """True once masks or an error were handed over (the event loop stops reading frames for the step)."""
        return self._settled.is_set()

    def deliver(self, frame: worker_pb2.LateTokenMasks) -> None:
        """Checks ``frame`` against the step (``check_late_masks``) and hands its masks, or the refusal, to the
        waiting compute thread."""
        try:
            masks = check_late_masks(frame, self.step_id, self.announced, self.vocab_size)
        except StepError as exc:
            self.fail(exc)
            return
        self._settle(masks, None)

    def fail(self, error: StepError) -> None:
        """Ends the wait with ``error`` (the step is refused); nothing when the masks were already handed over."""
        self._settle({}, error)

    def _settle(self, masks: dict, error: StepError | None) -> None:
        with self._lock:
            if self._settled.is_set():
                return
            self._masks, self._error = masks, error
            self._settled.set()

    def wait(self, timeout: float) -> dict[RequestId, worker_pb2.TokenMask]:
        """The step's late masks (request -> TokenMask; an announced request without one draws unmasked), once the
        frame came. Raises the refusal the event loop handed over, or a ``StepError`` after ``timeout`` seconds."""
        wanted, self._wanted = self._wanted, None
        if wanted is not None and not self._settled.is_set():
            wanted()
        if not self._settled.wait(timeout):
            self.fail(
                StepError(
                    code.STATE_MISMATCH,
                    f"step {self.step_id}: the late token masks its control announced (masks_follow: "
                    f"{len(self.announced)} requests) did not come within {timeout:g} s (--late-mask-timeout-seconds)",
                )
            )
        with self._lock:
            if self._error is not None:
                raise self._error
            return self._masks
