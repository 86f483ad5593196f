"""The running requests' part of a step: each one's next window, oldest first (a prefill window within the stall
bound, step_costs.py), preempting the newest when the KV pool runs out; and the step that clears the way for an isolated poison suspect (``poison.py``).
"""

from __future__ import annotations

from scheduler_svc.core.request import RequestStatus
from scheduler_svc.core.step_draft import StepDraft
from scheduler_svc.core.step_plan import RunningRequestData


def schedule_running(core, draft: StepDraft) -> None:
    """Gives running requests, oldest first, as many of their uncomputed tokens as the budget leaves, each window
    cut before an item whose encoder work does not fit; out of blocks, idle live sessions close first, then the
    newest running request is preempted (``core``: the Scheduler)."""
    kv, decider = core.kv, core.decider
    i = 0
    while i < len(core.running) and draft.budget > 0:
        r = core.running[i]
        if draft.alone is not None and r.request_id != draft.alone:
            i += 1
            continue  # an isolated suspect runs alone this step; the others hold their blocks
        start = r.num_computed_tokens
        window = draft.fit(core, r, decider.plan_window(r, start, start + min(r.num_tokens - start, draft.budget)))
        n = window.end - start
        if n <= 0:
            i += 1
            continue  # its next item's encoder work (or the stall bound) does not fit; it waits, holding its blocks
        while not kv.can_allocate(r.request_id, start + n):
            if core.live.close_idle_one():
                continue  # an idle live session's blocks come back before any running request is preempted
            victim = core.running.pop()
            core._preempt(victim)
            draft.preempted.append(victim.request_id)
            if victim is r:
                break  # the newest left was the request itself: requeued, so nothing is left to free
        if r.status is not RequestStatus.RUNNING:
            break  # it was the newest and preempted itself: nothing older may be taken from
        appended = kv.allocate(r.request_id, start + n)
        decider.commit_window(r, window)
        draft.spend(core, r, window)
        draft.running.append(RunningRequestData(r.request_id, r.all_token_ids[r.num_tokens_told :], appended, start, n))
        draft.take(r, n)
        i += 1


def clear_for_suspect(core, draft: StepDraft) -> None:
    """The isolated suspect did not fit beside the requests the ranks hold (blocks, encoder room, max_num_seqs):
    requeues them, so that it runs alone next step."""
    for victim in [r for r in reversed(core.running) if r.request_id != draft.alone]:
        core.running.remove(victim)
        core._preempt(victim)
        draft.preempted.append(victim.request_id)
        draft.finished_ids.append(victim.request_id)
