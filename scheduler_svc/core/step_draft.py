"""One step while ``Scheduler.schedule`` builds it, and the ``StepPlan`` it becomes.

The phases (``step_windows.schedule_running``, ``waiting_admission.admit_waiting``,
``step_windows.clear_for_suspect``) fill one ``StepDraft`` in order; ``assemble_plan`` turns it into the plan the
ranks are told, or None when there is nothing at all to tell them.
"""

from __future__ import annotations

import dataclasses

from common.errors import MmcastError
from common.ids import RequestId
from scheduler_svc.core.request import Request
from scheduler_svc.core.step_costs import is_decode, least_end
from scheduler_svc.core.step_plan import NewRequestData, RunningRequestData, StepPlan, StepWork
from scheduler_svc.core.structured_output import step_masks
from scheduler_svc.core.windows import Window


@dataclasses.dataclass
class StepDraft:
    budget: int  # tokens the step may still schedule (tokens)
    alone: RequestId | None  # the isolated poison suspect that runs alone this step, or None
    finished_ids: list[RequestId]  # the ranks drop these with the step: finished since the last plan, then preempted
    preempted: list[RequestId] = dataclasses.field(default_factory=list)  # requeued as new by this step
    scheduled: list[tuple[Request, int]] = dataclasses.field(default_factory=list)  # (request, tokens), in order
    new_requests: list[NewRequestData] = dataclasses.field(default_factory=list)  # admitted by this step
    running: list[RunningRequestData] = dataclasses.field(default_factory=list)  # deltas of the running ones
    # The stall bound (step_costs.py): seconds of prefill and encoder work the step may still carry while requests
    # decode; None: no time bound (nothing decodes, no --max-decode-stall-ms, or no decode step measured yet).
    work_s: float | None = None
    decoding_since: int = 0  # when the oldest running decode began (Scheduler.steps_applied): who is cut
    prefilled: bool = False  # a prefill window is in the step: later ones may be cut to nothing
    bounded: bool = False  # the time bound cut a window of this step

    def take(self, request: Request, n: int) -> None:
        """``request`` computes ``n`` tokens in this step (its step data is already added)."""
        request.num_tokens_told = request.num_tokens
        self.scheduled.append((request, n))
        self.budget -= n

    def fit(self, core, request: Request, window: Window) -> Window:
        """``window`` cut to the step's time left for prefill and encoder work, and planned again when cut; the
        step's first prefill window keeps at least ``least_end``'s. A decode token is never cut (the budget is what
        a step of decodes leaves), nor the prefill of a request queued before every running decode began: it is
        ahead of them, as the rest of a burst is ahead of the burst's first answers (``core``: the Scheduler)."""
        if self.work_s is None or window.end <= window.start or is_decode(request):
            return window
        if request.queued_at_step < self.decoding_since:
            return window
        end = max(window.start, core.costs.affordable_end(request, window, self.work_s))  # spent: nothing more
        if not self.prefilled:
            end = max(end, least_end(request, window, core.config.block_size))
        if end >= window.end:
            return window
        self.bounded = True
        return core.decider.plan_window(request, window.start, end)

    def spend(self, core, request: Request, window: Window) -> None:
        """A committed prefill window's estimated cost leaves the step's time budget."""
        if self.work_s is not None and not is_decode(request):
            self.work_s -= core.costs.window_cost(request, window)
            self.prefilled = True


def assemble_plan(core, draft: StepDraft) -> StepPlan | None:
    """The plan of a drafted step (``core``: the Scheduler; its decider has finished the step), or None when the
    ranks need to hear nothing: no window, no finish, no eviction, no reset."""
    decider = core.decider
    if not (draft.scheduled or draft.finished_ids or decider.mirrors.evict_payload_ids or core._reset_next):
        if core._requests:
            raise MmcastError(f"internal: {len(core._requests)} requests but nothing schedulable")
        return None
    accounting, released = decider.book.take_step(lambda rid: core._requests[rid].usage)
    scheduled = draft.scheduled
    sampling = [r for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens]
    plan = StepPlan(
        step_id=core._next_step_id,
        new_requests=draft.new_requests,
        running=draft.running,
        finished_request_ids=draft.finished_ids,
        preempted_request_ids=draft.preempted,
        encoder_inputs=decider.encoder_inputs,
        encoder_owners=decider.encoder_owners,
        evict_payload_ids=list(decider.mirrors.evict_payload_ids),
        evict_encoder_ids=decider.mirrors.evict_encoder_ids,
        reset_caches=core._reset_next,
        num_scheduled_tokens={r.request_id: n for r, n in scheduled},
        sampling_request_ids=[r.request_id for r in sampling],
        token_masks=step_masks(sampling),
        rank_payloads=decider.rank_payloads,
        accounting=accounting,
        items_examined=decider.items_examined,
        scheduled=scheduled,
        released=released,
        video_totals=decider.book.take_video(),
        work=StepWork(sum(n for r, n in scheduled if not is_decode(r)), decider.encoder_tokens),
        stall_bounded=draft.bounded,
    )
    core._next_step_id += 1
    core._reset_next = False
    core._outstanding = plan
    return plan
