"""Async scheduling in the core (``scheduler_svc/core/async_steps.py``): a plain decode step planned while the previous
one is in flight, exact block and token bookkeeping, requests that end in the step before, and constrained requests
planned ahead with their masks following once the step before is applied."""

from __future__ import annotations

import pytest

from common.errors import FailedPrecondition
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.inputs import GroupBudget
from scheduler_svc.core.request import FinishReason, Request, RequestSampling
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.transport.plan_proto import step_control
from tests.support.sched_sim import EOS, outcome

GROUP = GroupBudget(num_ranks=2, kv_blocks=64, encoder_cache_tokens=64, payload_cache_bytes=2048)
BLOCK = 16


def make() -> Scheduler:
    return Scheduler(SchedulerConfig(max_model_len=512, block_size=BLOCK), GROUP, uses_mrope=True, eos_token_ids={EOS})


def add(s: Scheduler, rid: str, n: int = BLOCK - 1, **sampling) -> None:
    sampling.setdefault("max_tokens", 8)
    s.add_request(Request(rid, list(range(1, n + 1)), [], RequestSampling(**sampling)))


def decoding(*rids: str, **sampling) -> Scheduler:
    """A core whose requests were admitted and prefilled: the next plan is a plain decode step."""
    s = make()
    for rid in rids:
        add(s, rid, **sampling)
    plan = s.schedule()
    s.update_from_output(plan, outcome({rid: 100 for rid in rids}))
    return s


def test_a_decode_step_is_planned_ahead_with_the_last_sampled_token_as_input():
    s = decoding("a", "b")
    k = s.schedule()
    ahead = s.schedule_ahead()
    assert ahead is not None and ahead.step_id == k.step_id + 1 and s.schedule_ahead() is None
    by_id = {d.request_id: d for d in ahead.running}
    a = s.get_request("a")
    # "a": 15 prompt tokens + 1 output; step k computes index 15 (filling block 1), the step ahead index 16 (k's
    # token) in a new block.
    assert by_id["a"].input_is_last_sampled and by_id["a"].new_token_ids == []
    assert (by_id["a"].num_computed_tokens, by_id["a"].num_scheduled_tokens) == (a.num_tokens, 1)
    assert len(by_id["a"].new_block_ids) == 1 and len(s.kv.blocks_of("a")) == 2
    assert ahead.sampling_request_ids == ["a", "b"] and not ahead.new_requests
    got_k = {u.request_id: u.new_token_ids for u in s.update_from_output(k, outcome({"a": 7, "b": 8}))}
    assert got_k == {"a": [7], "b": [8]}
    got = {u.request_id: u.new_token_ids for u in s.update_from_output(ahead, outcome({"a": 9, "b": 10}))}
    assert got == {"a": [9], "b": [10]}
    assert a.output_token_ids == [100, 7, 9] and a.num_computed_tokens == a.num_tokens - 1
    nxt = s.schedule()  # synchronous again: the ranks hold k's token (their own), so only the ahead step's travels
    assert {d.request_id: d.new_token_ids for d in nxt.running} == {"a": [9], "b": [10]}
    assert all(not d.input_is_last_sampled for d in nxt.running)


def test_a_request_ending_in_step_k_gets_nothing_of_the_step_ahead_and_its_blocks_are_freed():
    s = decoding("a", "b")
    k = s.schedule()
    ahead = s.schedule_ahead()
    assert set(ahead.num_scheduled_tokens) == {"a", "b"}
    updates = {u.request_id: u for u in s.update_from_output(k, outcome({"a": EOS, "b": 8}))}
    assert updates["a"].finished is FinishReason.STOP
    assert s.schedule_ahead() is None  # the ranks must hear that "a" ended: the next step waits for the answer
    after = s.update_from_output(ahead, outcome({"a": 55, "b": 10}))  # "a"'s token of the step ahead: dropped
    assert [(u.request_id, u.new_token_ids) for u in after] == [("b", [10])]
    nxt = s.schedule()
    assert nxt.finished_request_ids == ["a"] and list(nxt.num_scheduled_tokens) == ["b"]
    blocks_b = -(-s.get_request("b").num_tokens // BLOCK)
    assert s.stats.kv_blocks_used == blocks_b  # "a"'s blocks, the one taken for the step ahead too, are free


def test_a_request_whose_last_token_step_k_gives_is_left_out_of_the_step_ahead():
    s = make()
    add(s, "short", max_tokens=2)
    add(s, "long", max_tokens=8)
    plan = s.schedule()
    s.update_from_output(plan, outcome({"short": 100, "long": 100}))
    k = s.schedule()
    ahead = s.schedule_ahead()
    assert list(ahead.num_scheduled_tokens) == ["long"]
    updates = {u.request_id: u for u in s.update_from_output(k, outcome({"short": 5, "long": 6}))}
    assert updates["short"].finished is FinishReason.LENGTH and updates["short"].new_token_ids == [5]
    assert [u.new_token_ids for u in s.update_from_output(ahead, outcome({"long": 7}))] == [[7]]


def test_no_step_is_planned_ahead_of_a_prefill_or_while_a_request_waits():
    s = make()
    add(s, "a")
    s.schedule()
    assert s.schedule_ahead() is None  # step k is a prefill
    s = decoding("a")
    add(s, "late")
    s.schedule()
    assert s.schedule_ahead() is None  # "late" is admitted first, by a synchronous plan


def test_a_recovery_with_two_steps_in_flight_requeues_the_applied_tokens_only():
    s = decoding("a")
    k = s.schedule()
    ahead = s.schedule_ahead()
    s.update_from_output(k, outcome({"a": 7}))
    assert ahead is not None
    s.recover("rank 1 lost")  # the step ahead is void: its token never existed
    s.reset_group(GROUP)
    [resumed] = s.schedule().new_requests
    assert resumed.prompt_token_ids[-2:] == [100, 7] and resumed.num_output_tokens == 2


class CountingGrammar:
    """A stand-in for a request's matcher: its mask says how many tokens it consumed (so a mask computed before a
    token and one computed after it differ); complete after ``length`` tokens."""

    def __init__(self, length: int) -> None:
        self.consumed: list[int] = []
        self.length = length

    def mask(self) -> bytes:
        return bytes([len(self.consumed)]) * 4

    def advance(self, token: int) -> bool:
        self.consumed.append(token)
        return True

    @property
    def complete(self) -> bool:
        return len(self.consumed) >= self.length

    error = ""


def constrained(length: int) -> tuple[Scheduler, CountingGrammar]:
    """A decoding core with an unconstrained request "free" and a constrained one "c"."""
    s = make()
    add(s, "free")
    add(s, "c")
    grammar = s.get_request("c").grammar = CountingGrammar(length)
    plan = s.schedule()
    s.update_from_output(plan, outcome({"free": 100, "c": 100}))
    return s, grammar


def test_a_constrained_request_is_planned_ahead_only_where_its_mask_may_follow():
    s, grammar = constrained(length=10)
    k = s.schedule()
    assert k.token_masks == {"c": bytes([1]) * 4}  # a synchronous plan carries the mask
    assert s.schedule_ahead() is None  # the group does not take late masks: lock-step
    ahead = s.schedule_ahead(late_masks=True)
    assert ahead.sampling_request_ids == ["free", "c"] and ahead.masks_follow == ["c"] and not ahead.token_masks
    assert list(step_control(ahead).masks_follow) == ["c"]
    with pytest.raises(FailedPrecondition, match="once the step before it is applied"):
        s.late_masks(ahead)  # step k's token is not known yet
    s.update_from_output(k, outcome({"free": 7, "c": 41}))
    assert s.late_masks(ahead) == {"c": bytes([2]) * 4}  # computed after the grammar consumed k's token
    got = {u.request_id: u.new_token_ids for u in s.update_from_output(ahead, outcome({"free": 8, "c": 42}))}
    assert got == {"free": [8], "c": [42]} and grammar.consumed == [100, 41, 42]


def test_a_constrained_request_its_grammar_ends_in_step_k_gets_no_late_mask_nor_its_token_of_the_step_ahead():
    s, grammar = constrained(length=2)  # complete with its token of step k
    k = s.schedule()
    ahead = s.schedule_ahead(late_masks=True)
    updates = {u.request_id: u for u in s.update_from_output(k, outcome({"free": 7, "c": 41}))}
    assert updates["c"].finished is FinishReason.STOP and updates["c"].new_token_ids == [41]
    assert s.late_masks(ahead) == {}  # rank 0 draws it unmasked ...
    after = s.update_from_output(ahead, outcome({"free": 8, "c": 55}))
    assert [(u.request_id, u.new_token_ids) for u in after] == [("free", [8])]  # ... and that token is dropped
    assert grammar.consumed == [100, 41]
    assert s.schedule().finished_request_ids == ["c"]
