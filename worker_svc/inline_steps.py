"""Which steps a rank runs on its event loop's own thread instead of handing them to its compute thread.

A step handed to the compute thread costs two hand-overs between threads: the compute thread wakes for it, and the
event loop wakes for its answer. On a 2-vCPU VM each is a thread's wake-up, together ~0.23 ms of a tiny model's
~1.8 ms decode step (docs/PERFORMANCE.md, "Decode steps on the event loop's thread", has the figures). The event
loop, in turn, answers nothing else (health checks, a superseding handshake, other streams) while a step runs on it,
so only steps predicted short run there:

- steps of running requests alone: no admission (a prompt to take in, payloads to assemble), no encoder input, no
  cache reset;
- whose scheduled tokens (a decode step's: one per request) fall in a size class whose recent steps took at most
  ``--inline-step-max-ms``. The estimate of a class (powers of two of the token count) rises at once to a slower
  step and decays towards faster ones, so a step that ran long sends the next ones of its size to the compute
  thread; a class not measured yet runs there first;
- while the compute thread is idle: a step never runs beside another stream's step or cache clearing.
- on a rank of one intra-op thread (``Worker.loop_computes``: ``--threads 1``, which serve-local gives a rank on a
  2-CPU machine). With more, torch work on the loop's thread starts a second OpenMP team beside the compute thread's,
  and the runtime then throttles how both teams wait between parallel regions: one 1-row step on the loop's thread
  made every later 16-request decode step at Qwen2-VL-2B widths (2 threads) 33 -> 39 ms in process, 38 -> 52 ms
  served. Such a rank keeps every step on the compute thread.

Every step, wherever it ran, is measured into its class. ``--inline-step-max-ms 0`` runs every step on the compute
thread.
"""

from __future__ import annotations

from mmcast.v1 import worker_pb2

MAX_TOKENS = 1024  # steps of more scheduled tokens always run on the compute thread
_DECAY = 0.25  # weight of a faster step in its class's estimate


def step_tokens(control: worker_pb2.StepControl) -> int | None:
    """The tokens a step of running requests alone schedules, or None for a step that admits requests, encodes
    items or resets caches (always on the compute thread)."""
    if control.new_requests or control.encoder_inputs or control.reset_caches:
        return None
    return sum(r.num_scheduled_tokens for r in control.running)


def _size_class(tokens: int) -> int:
    return max(tokens, 1).bit_length()


class InlineSteps:
    """The rank's choice per step, from the measured time of earlier steps of the same size class."""

    def __init__(self, max_seconds: float) -> None:
        self.max_seconds = max_seconds
        self._estimate: dict[int, float] = {}  # size class -> seconds

    def fits(self, control: worker_pb2.StepControl) -> bool:
        """True when ``control`` may run on the event loop's thread (the caller checks the compute thread is idle)."""
        if self.max_seconds <= 0:
            return False
        tokens = step_tokens(control)
        if tokens is None or tokens > MAX_TOKENS:
            return False
        estimate = self._estimate.get(_size_class(tokens))
        return estimate is not None and estimate <= self.max_seconds

    def observe(self, control: worker_pb2.StepControl, seconds: float) -> None:
        """Records how long ``control``'s step took (on either thread)."""
        tokens = step_tokens(control)
        if tokens is None or tokens > MAX_TOKENS:
            return
        key = _size_class(tokens)
        before = self._estimate.get(key)
        if before is None or seconds >= before:
            self._estimate[key] = seconds
        else:
            self._estimate[key] = before + _DECAY * (seconds - before)
