"""Group loss and reconnect: the step in flight voided (poison isolation judging its requests), every cache gone,
running requests requeued as new; then the new group's budgets, under which waiting requests may no longer fit.
"""

from __future__ import annotations

from common.errors import FailedPrecondition, MmcastError, Status
from scheduler_svc.core.inputs import GroupBudget
from scheduler_svc.core.request import FinishReason, RequestStatus
from scheduler_svc.core.step_plan import RequestUpdate


def recover(core, reason: str = "") -> list[RequestUpdate]:
    """``Scheduler.recover`` (``core``: the Scheduler): the final updates of the convicted poison request and of the
    live turns, which cannot go on."""
    poisoned: list[RequestUpdate] = []
    if core._outstanding is not None:
        convicted = _judge_step(core, reason)
        if convicted is not None:
            poisoned.append(convicted)
    core._outstanding = core._ahead = None
    for r in [r for r in (*core.running, *core.waiting) if r.live is not None]:
        if r in core.waiting:
            core.waiting.remove(r)
        # the ranks' KV is gone with the group: a live turn cannot go on, nor its session
        poisoned.append(core._fail_live(r, "the worker group restarted", Status.UNAVAILABLE, told=False))
    core._deferred = [u for u in core._deferred if all(u is not p for p in poisoned)]
    core.live.drop_all()
    for r in core.running:
        core.kv.free(r.request_id)
        r.reset_progress()
        r.status = RequestStatus.WAITING
        r.usage.preemptions += 1  # requeued by the recovery; resumed as new like a preempted request
    core.waiting.extendleft(reversed(core.running))
    core.running = []
    core.kv.reset_prefix_cache()
    core.decider.reset()
    core._pending_finished = []  # fresh ranks hold no request
    core._reset_next = True
    return poisoned


def _judge_step(core, reason: str) -> RequestUpdate | None:
    """Poison isolation's verdict on the step in flight: the final update of the request it convicts, or None."""
    step = {
        r.request_id: r.num_computed_tokens + n
        for r, n in core._outstanding.scheduled
        if core._requests.get(r.request_id) is r
    }
    convicted = core.isolator.step_failed(step)
    if convicted is None:
        return None
    r = core._requests[convicted]
    core._finish(r, FinishReason.ERROR)  # a scheduled request is running until the step's output
    return RequestUpdate(
        r.request_id,
        [],
        None,
        finished=FinishReason.ERROR,
        usage=r.usage,
        error_status=Status.INTERNAL,
        error=f"request {r.request_id} crashed the worker group twice, the second time running alone; "
        "it is failed so that the group keeps serving the other requests"
        + (f"; the group was lost: {reason}" if reason else ""),
    )


def reset_group(core, group: GroupBudget) -> list[RequestUpdate]:
    """``Scheduler.reset_group``: the new budgets; the final updates of the waiting requests that no longer fit."""
    if core.running or core._outstanding is not None:
        raise FailedPrecondition("reset_group() needs no running request and no step in flight; recover() first")
    core._apply_group(group)
    core._reset_next = True
    failed = []
    for r in list(core.waiting):
        try:
            core._check_fits_group(r)
        except MmcastError as exc:
            update = core.finish_request(r.request_id, FinishReason.ERROR, error=exc.message)
            failed.append(update)
    return failed
