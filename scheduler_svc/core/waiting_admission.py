"""The waiting requests' part of a step: admission in order (FCFS: the first that cannot be admitted stops it),
each with its prefix-cache hit (or its live session's retained KV), its first window (within the stall bound while
requests decode, step_costs.py), its payloads and its blocks.
"""

from __future__ import annotations

from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.step_draft import StepDraft
from scheduler_svc.core.step_plan import NewRequestData


def admit_waiting(core, draft: StepDraft) -> None:
    """Admits waiting requests while ``max_num_seqs`` and the budget allow; only the isolated suspect while one is
    isolated (``core``: the Scheduler)."""
    kv, decider, bs = core.kv, core.decider, core.config.block_size
    while core.waiting and len(core.running) < core.config.max_num_seqs and draft.budget > 0:
        r = core.waiting[0] if draft.alone is None else core._requests[draft.alone]
        if draft.alone is not None and (r.status is not RequestStatus.WAITING or draft.scheduled):
            break  # the isolated suspect is running, or was just scheduled: nothing joins it
        if r.request_id in draft.finished_ids:
            break  # the ranks drop the finished request of the same id with this step; admit it next step
        if r.live is not None:  # the session's retained KV, never looked up in the prefix cache
            prefix, computed = r.live.blocks, r.live.computed
        else:
            prefix = kv.find_prefix(r)
            computed = len(prefix) * bs
        decider.place_cursor(r, computed)
        window = decider.plan_window(r, computed, computed + min(r.num_tokens - computed, draft.budget))
        window = draft.fit(core, r, window)  # the stall bound: what the step's time left allows (step_costs.py)
        n = window.end - computed
        if n <= 0 or not decider.admission_fits(r):
            break  # FCFS: wait for room rather than let later requests overtake
        appended = kv.allocate(r.request_id, computed + n, prefix, r.num_prompt_tokens + r.sampling.max_tokens)
        if appended is None and core.live.close_idle_one():
            continue  # an idle live session gave its blocks back: try the head again
        if appended is None:
            break  # out of blocks: FCFS, the head waits and nothing overtakes it
        core.waiting.remove(r)  # the head, unless an isolated suspect is taken out of turn
        core.running.append(r)
        _start(core, r, computed)
        wire_items = decider.commit_admission(r, computed)
        decider.commit_window(r, window)
        draft.spend(core, r, window)
        draft.new_requests.append(_new_request_data(r, wire_items, appended, computed, n))
        if r.live is not None:
            r.live.admitted = True
        draft.take(r, n)


def _start(core, r: Request, computed: int) -> None:
    """The request runs from its ``computed`` prefix; its first admission counts the prefix as cached."""
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = computed
    core.kv.record_lookup(r.num_tokens, computed)
    if not r.admitted_once:
        r.admitted_once = True
        r.usage.cached_tokens = computed


def _new_request_data(r: Request, wire_items, appended, computed: int, n: int) -> NewRequestData:
    return NewRequestData(
        r.request_id,
        list(r.all_token_ids),
        wire_items,
        r.sampling,
        appended,
        computed,
        n,
        r.num_output_tokens,
        None if r.live is None else r.live.context,
    )
