"""Async scheduling: the next step planned while the step in flight runs, before its tokens are known.

``plan_ahead`` builds step k+1 from step k (in flight) when k is a plain decode step of every running request, so
that k+1 needs nothing k's answer could change but the tokens themselves: each request computes one token whose
input is the token the ranks sample for it in step k (``RunningRequestData.input_is_last_sampled``). Anything
else waits for step k's answer and goes through ``Scheduler.schedule`` as before. When a request ends in step k
(EOS, a stop token) its step-k+1 token is dropped by ``update_from_output`` (it is no longer running), never
delivered nor counted, and the next synchronous plan tells the ranks to drop it.

A request with a grammar needs step k's token for its step-k+1 mask. With a group whose every rank takes late masks
(``HandshakeAck.late_token_masks``) it is planned ahead all the same: k+1 names it in ``masks_follow`` instead of
carrying its mask, and once step k's answer is applied (its grammar consumed k's token) ``late_masks`` gives the
masks the engine sends to rank 0 (in k+2's control, or a frame of their own), which runs k+1's forward meanwhile and
waits for them before it samples. A request that step k ended (its grammar complete, EOS, a rejected token) gets no
mask: rank 0 draws its k+1 token unmasked, and that token is dropped like any other of a request that ended in step k.

Rules (all must hold, else None):
- step k is outstanding and nothing is planned ahead of it yet;
- no request waits (admission goes first), none ended since step k was planned (the ranks must hear of it), no
  recovery reset is due, no poison suspect is being isolated;
- every running request is in step k with one token that it samples (a plain decode step: no prefill chunk, no
  item window), outside a live session, and without a grammar unless the group takes late masks;
- a request that step k surely ends by length is left out (the ranks hold it one step more, computing nothing);
- the pool has a slot for every remaining request's next token.
"""

from __future__ import annotations

from common.errors import FailedPrecondition
from common.ids import RequestId
from scheduler_svc.core.accounting_events import ItemAccounting
from scheduler_svc.core.step_plan import RunningRequestData, StepPlan


def plan_ahead(core, late_masks: bool = False) -> StepPlan | None:
    """Step k+1 of the core's outstanding step k, or None when a rule above does not hold. ``core``: a Scheduler;
    ``late_masks``: every rank of the group takes masks after the control (constrained requests may be planned)."""
    step = core._outstanding
    if step is None or core._ahead is not None or step.new_requests or step.encoder_inputs:
        return None
    if core.waiting or core._pending_finished or core._reset_next or core.isolator.suspects:
        return None
    in_step = {r.request_id: (r, n) for r, n in step.scheduled}
    if len(in_step) != len(core.running):
        return None  # a running request is held back this step (isolation, encoder room): keep the step order
    picks = []
    for r in core.running:
        mine, n = in_step.get(r.request_id, (None, 0))
        if mine is not r or n != 1 or r.num_computed_tokens + 1 != r.num_tokens:
            return None  # not one sampled decode token in step k
        if (r.grammar is not None and not late_masks) or r.live is not None:
            return None
        if r.num_output_tokens + 1 >= r.sampling.max_tokens or r.num_tokens + 1 >= core.max_model_len:
            continue  # step k gives its last token
        picks.append(r)
    if not picks or not all(core.kv.can_allocate(r.request_id, r.num_tokens + 1) for r in picks):
        return None
    deltas, scheduled = [], []
    for r in picks:
        start = r.num_tokens  # computed once step k ran; its input is step k's token
        appended = core.kv.allocate(r.request_id, start + 1)
        deltas.append(RunningRequestData(r.request_id, [], appended, start, 1, input_is_last_sampled=True))
        r.num_tokens_told = start + 1  # the ranks append step k's token themselves
        scheduled.append((r, 1))
    plan = StepPlan(
        step_id=core._next_step_id,
        new_requests=[],
        running=deltas,
        finished_request_ids=[],
        preempted_request_ids=[],
        encoder_inputs=[],
        encoder_owners=[],
        evict_payload_ids=[],
        evict_encoder_ids=[],
        reset_caches=False,
        num_scheduled_tokens={r.request_id: 1 for r in picks},
        sampling_request_ids=[r.request_id for r in picks],
        rank_payloads=[[] for _ in range(core.decider.num_ranks)],
        accounting={},
        items_examined=0,
        scheduled=scheduled,
        released=ItemAccounting(),
        video_totals=ItemAccounting(),
        masks_follow=[r.request_id for r in picks if r.grammar is not None],
    )
    core._next_step_id += 1
    core._ahead = plan
    return plan


def late_masks(core, plan: StepPlan) -> dict[RequestId, bytes]:
    """The masks ``plan`` announced in ``masks_follow``, once the step before it is applied (``plan`` is now the
    core's outstanding step): each grammar has consumed that step's token. A request that ended since, or whose id
    now names another request, gets none (its token of ``plan`` is dropped)."""
    if plan is not core._outstanding:
        raise FailedPrecondition(f"step {plan.step_id}: its late masks come once the step before it is applied")
    planned = {r.request_id: r for r, _ in plan.scheduled}
    out: dict[RequestId, bytes] = {}
    for rid in plan.masks_follow:
        r = planned[rid]
        if core._requests.get(rid) is r and not r.is_finished:
            out[rid] = r.grammar.mask()
    return out
