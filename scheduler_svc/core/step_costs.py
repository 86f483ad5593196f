"""The stall bound: what a step's prefill and encoder work costs on the ranks, measured, and how much of it a step
may carry while requests decode (``--max-decode-stall-ms``; docs/ARCHITECTURE.md §2.3).

A decoding request gets one token per step, so the time between its tokens is the time of the steps it is in. A
step that also encodes new images and prefills new prompts makes every decode in it wait for that work. The token
and encoder budgets bound the work's size, not its time: four new 448×448 images, well within both, cost a CPU
several hundred milliseconds. So while any request decodes, a step's prefill and encoder work is also bounded by
time: its estimated cost may not exceed the stall target less what a step of decodes alone takes. With nothing
decoding no one waits between tokens, and the size budgets alone apply. Only the work of requests queued after the
oldest running decode began is cut: a request that was already waiting is ahead of the decodes that began since,
so a burst arriving at an idle group is prefilled as fast as without the bound, although its first answers decode
while the rest of it prefills (``Request.queued_at_step``, ``first_token_at_step``, counted in applied steps). The
same idea as stall-free batching with a token budget chosen from a time-between-tokens target (Sarathi-Serve), with
the costs measured as the group runs instead of profiled before.

The model is linear, one rate per kind of work, each from the ranks' own clocks (``WorkerStepStats``: the slowest
rank's ``step_time`` and ``encoder_time``, which includes decoding and preprocessing encoded images):

- ``decode_step``: the step time of steps with no prefill token and no encoder row (the step every decode is in
  anyway);
- ``encoder_row``: encoder time per encoder-output row scheduled;
- ``prefill_token``: the rest of a step's time (its time less its encoder time and a decode step's) per prefill
  token.

Each rate is an exponentially weighted average of the measured cost and, separately, of the work it paid for; the
rate is their ratio, so a large step weighs more than a small one and a step of three tokens does not swing it. A
rate not measured yet counts as free: until the group has run a step of that kind, that work is bounded by the size
budgets alone (the first burst after a start is not time-bounded; it measures the rates).

A step's first prefill window is never cut below one block of tokens (and an item that starts within that block is
encoded whole), so every step makes progress and nothing starves when one image alone costs more than the target;
the running decodes then wait for that one item, not for a whole budget of them.
"""

from __future__ import annotations

import math

from scheduler_svc.core.request import Request
from scheduler_svc.core.step_plan import StepWork
from scheduler_svc.core.windows import Window

ALPHA = 0.25  # weight of the latest step in each average: a step's own noise moves a rate by at most a quarter of it


class _Rate:
    """The cost of one unit of some work: the ratio of the averaged cost to the averaged units it paid for."""

    __slots__ = ("cost", "units")

    def __init__(self) -> None:
        self.cost = 0.0  # seconds
        self.units = 0.0  # units (tokens, rows, steps)

    def observe(self, seconds: float, units: float) -> None:
        if units <= 0:
            return
        if self.units == 0.0:
            self.cost, self.units = max(0.0, seconds), units
            return
        self.cost += ALPHA * (max(0.0, seconds) - self.cost)
        self.units += ALPHA * (units - self.units)

    @property
    def per_unit(self) -> float | None:
        """Seconds per unit, or None before the first observation."""
        return self.cost / self.units if self.units else None


def is_decode(request: Request) -> bool:
    """A request that streams tokens and has one to compute: it waits for every step it is in between tokens."""
    return request.num_output_tokens > 0 and request.num_tokens - request.num_computed_tokens == 1


class StepCosts:
    """The three rates, updated from every step's outcome; the time budget of a step's prefill and encoder work."""

    def __init__(self, max_stall_seconds: float) -> None:
        self.max_stall_seconds = max_stall_seconds  # --max-decode-stall-ms / 1000; 0: no time bound
        self.decode_step = _Rate()
        self.encoder_row = _Rate()
        self.prefill_token = _Rate()

    def observe(self, work: StepWork, step_seconds: float, encoder_seconds: float) -> None:
        """One step's measured times (the slowest rank's step and encoder times) for the work it carried."""
        if not work.prefill_tokens and not work.encoder_rows:
            self.decode_step.observe(step_seconds, 1)
            return
        self.encoder_row.observe(encoder_seconds, work.encoder_rows)
        base = self.decode_step.per_unit
        if base is not None:  # the rest of the step, beyond the decode step it would have been anyway
            self.prefill_token.observe(step_seconds - encoder_seconds - base, work.prefill_tokens)

    def work_budget(self) -> float | None:
        """Seconds of prefill and encoder work a step with decodes may carry, or None when nothing bounds it (no
        target, or no decode step measured yet)."""
        base = self.decode_step.per_unit
        if not self.max_stall_seconds or base is None:
            return None
        return max(0.0, self.max_stall_seconds - base)

    def rates(self) -> tuple[float, float]:
        """(seconds per prefill token, seconds per encoder row); a rate not measured yet is 0 (free)."""
        return self.prefill_token.per_unit or 0.0, self.encoder_row.per_unit or 0.0

    def estimates(self) -> dict[str, float | None]:
        """The rates in seconds (None: not measured yet), for the gauges."""
        return {
            "decode_step": self.decode_step.per_unit,
            "prefill_token": self.prefill_token.per_unit,
            "encoder_row": self.encoder_row.per_unit,
        }

    def window_cost(self, request: Request, window: Window) -> float:
        """Estimated seconds of a prefill window: its tokens and the rows of the items it encodes."""
        token_s, row_s = self.rates()
        rows = sum(request.mm_features[i].mm_position.get_num_embeds() for i in window.encode)
        return (window.end - window.start) * token_s + rows * row_s

    def affordable_end(self, request: Request, window: Window, seconds: float) -> int:
        """The furthest end of ``window`` whose cost fits ``seconds``: its tokens in order, each item's rows paid at
        its first token (a window ending at an item's offset leaves it for a later step)."""
        token_s, row_s = self.rates()
        left, pos = seconds, window.start
        for i in window.encode:
            position = request.mm_features[i].mm_position
            offset = max(position.offset, window.start)  # a partly covered item is paid at the window's start
            if (offset - pos) * token_s > left:
                break
            left -= (offset - pos) * token_s
            pos = offset
            rows_s = position.get_num_embeds() * row_s
            if rows_s > left:
                return pos  # cut before the item: its encoder work waits for a later step
            left -= rows_s
        if token_s <= 0:
            return window.end
        return min(window.end, pos + math.floor(left / token_s + 1e-9))


def least_end(request: Request, window: Window, block_size: int) -> int:
    """Where a step's first prefill window may be cut at the earliest: one block of tokens, and the whole of an
    item it encodes that starts within that block (its rows and placeholder tokens), so every step makes progress."""
    end = window.start + block_size
    for i in window.encode:
        position = request.mm_features[i].mm_position
        if position.offset >= end:
            break
        end = max(end, position.end)
    return min(window.end, end)
