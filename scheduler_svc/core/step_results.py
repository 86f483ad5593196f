"""A finished step's results applied to the core: the computed tokens, the blocks that enter the prefix cache, rank
0's sampled tokens with their stop checks, and the requests that failed (at rank 0, or holding an image an owner rank
could not decode).
"""

from __future__ import annotations

from collections.abc import Mapping

from common.errors import FailedPrecondition, Status
from common.ids import ItemId, RequestId
from scheduler_svc.core.inputs import GroupStepOutcome
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from scheduler_svc.core.step_plan import RequestUpdate, StepPlan
from scheduler_svc.core.structured_output import grammar_verdict


class StepOutputError(FailedPrecondition):
    """Rank 0's sampled tokens do not match the plan (missing or unexpected); the group must be recovered."""


def apply_outcome(core, plan: StepPlan, outcome: GroupStepOutcome) -> list[RequestUpdate]:
    """``Scheduler.update_from_output`` (``core``: the Scheduler): checks the outcome against the plan, then
    applies it request by request."""
    if plan is not core._outstanding:
        raise FailedPrecondition(f"step {plan.step_id} is not the step in flight (stale after a recovery?)")
    live = [(r, n) for r, n in plan.scheduled if core._requests.get(r.request_id) is r and not r.is_finished]
    expected = {r.request_id for r, n in live if r.num_computed_tokens + n == r.num_tokens}
    bad_items = _failed_items(core, outcome.item_failures)
    spoiled = {rid for rid in core._requests if rid in bad_items}  # hold a failed item: none may sample
    _check_matches(plan, outcome, live, expected, spoiled)
    core._outstanding, core._ahead = core._ahead, None
    core.steps_applied += 1
    if outcome.step_seconds is not None:  # the ranks' clocks price the step's work (the stall bound's rates)
        core.costs.observe(plan.work, outcome.step_seconds, outcome.encoder_seconds)
    core.decider.mirrors.end_step()
    updates = [_fail_item(core, core._requests[rid], *bad_items[rid]) for rid in spoiled]
    for r, n in live:
        if r.request_id in spoiled:
            continue  # failed with its image above: its step's progress is void
        r.num_computed_tokens += n
        if r.live is None:
            core.kv.cache_full_blocks(r)
        core.decider.advance(r)
        if r.request_id in expected:  # else a prefill chunk: nothing sampled
            updates.append(_sampled(core, r, outcome))
    if core.isolator.suspects:
        core.isolator.step_completed({r.request_id: r.num_computed_tokens for r, _ in live})
    return updates


def _check_matches(plan: StepPlan, outcome: GroupStepOutcome, live, expected: set, spoiled: set) -> None:
    """Raises StepOutputError (nothing changed yet) when rank 0's answers do not match the requests that sample."""
    sampled, failed = outcome.sampled, outcome.failed
    dropped = {r.request_id for r, _ in plan.scheduled} - {r.request_id for r, _ in live}  # finished meanwhile
    missing = expected - set(sampled) - set(failed) - spoiled
    unexpected = (set(sampled) | set(failed)) - expected - dropped
    both = set(sampled) & set(failed)
    if missing or unexpected or both:
        raise StepOutputError(
            f"step {plan.step_id}: rank 0 returned no token for {sorted(missing)} and unexpected tokens for "
            f"{sorted(unexpected)}" + (f"; both a token and a failure for {sorted(both)}" if both else "")
        )


def _sampled(core, r: Request, outcome: GroupStepOutcome) -> RequestUpdate:
    """The update of a request whose window reached its end: its token and stop checks, or its failure at rank 0
    (it ends here, without a token)."""
    if r.request_id in outcome.failed:
        core._finish(r, FinishReason.ERROR)
        return RequestUpdate(
            r.request_id,
            [],
            None,
            finished=FinishReason.ERROR,
            usage=r.usage,
            error=f"request {r.request_id} failed at the worker: {outcome.failed[r.request_id]}",
            error_status=Status.INTERNAL,
        )
    sample = outcome.sampled[r.request_id]
    token = sample.token_id
    if not r.num_output_tokens:
        r.first_token_at_step = core.steps_applied  # it decodes from here on (the stall bound's reference)
    r.append_output(token)
    update = RequestUpdate(
        r.request_id, [token], [(sample.logprob, sample.top_logprobs)] if r.sampling.return_logprobs else None
    )
    reason = stop_reason(r, token, core.eos_token_ids, core.max_model_len)
    if reason is FinishReason.STOP:
        update.stop_token_id = token
    elif r.grammar is not None:  # the grammar consumes the token; complete, it ends the request
        reason = grammar_verdict(r.grammar, token, update) or reason
    if reason is not None:
        core._finish(r, reason)
        update.finished, update.usage = reason, r.usage
    return update


def stop_reason(r: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Why the request ends with ``token`` (a stop token or EOS, its length), or None."""
    if token in r.sampling.stop_token_ids or (not r.sampling.ignore_eos and token in eos_token_ids):
        return FinishReason.STOP
    if r.num_output_tokens >= r.sampling.max_tokens or r.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def _failed_items(core, item_failures: Mapping[ItemId, str]) -> dict[RequestId, tuple[int, str]]:
    """Requests holding a failed item: request id -> (index of its first failed image, message)."""
    out: dict[RequestId, tuple[int, str]] = {}
    if not item_failures:
        return out
    for rid, r in core._requests.items():
        for k, f in enumerate(r.mm_features):
            if f.identifier in item_failures:
                out[rid] = (k, item_failures[f.identifier])
                break  # the first failed image names the error
    return out


def _fail_item(core, r: Request, index: int, message: str) -> RequestUpdate:
    """Ends a request whose image ``index`` failed at its owner rank (INVALID_ARGUMENT); the failed item's
    encoder-mirror entry goes with its last holder (the ranks never stored an output for it)."""
    key = r.mm_features[index].identifier
    if r.status is RequestStatus.RUNNING:
        core._finish(r, FinishReason.ERROR)
    else:
        core.finish_request(r.request_id, FinishReason.ERROR)
    core.decider.mirrors.forget_encoder(key)
    field = r.image_fields[index] if index < len(r.image_fields) else None
    where = field or f"image {index} of the prompt"
    return RequestUpdate(
        r.request_id,
        [],
        None,
        finished=FinishReason.ERROR,
        usage=r.usage,
        error=f"{where} (item {key[:16]}) could not be used: {message}",
        error_status=Status.INVALID_ARGUMENT,
        error_field=field,
    )
