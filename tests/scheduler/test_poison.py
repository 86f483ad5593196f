"""Poison isolation, in layers: the decisions of ``PoisonIsolator`` with exact expectations, then the scheduler core
driven by the simulated rank group of ``tests/support/sched_sim.py`` with a group that crashes whenever a given
request is in the step (or only when it reaches a given token), checking that exactly that request is failed and
that every other request's tokens equal those of a run without it."""

from __future__ import annotations

import dataclasses

import pytest

from common.errors import Status
from common.ids import RequestId
from scheduler_svc.core.poison import PoisonIsolator
from scheduler_svc.core.request import FinishReason
from scheduler_svc.transport.plan_proto import step_control
from tests.support.sched_sim import Harness, outcome, request, sample_token, text

# --- the decisions -----------------------------------------------------------------------------------------------


def ids(*names: str) -> dict[RequestId, int]:
    return {RequestId(n): 10 for n in names}


def test_first_failure_makes_suspects_and_nobody_runs_alone():
    iso = PoisonIsolator()
    assert iso.step_failed({"a": 20, "b": 33}) is None
    assert {k: (s.reach, s.isolated, s.failures) for k, s in iso.suspects.items()} == {
        "a": (20, False, 1),
        "b": (33, False, 1),
    }
    assert iso.alone(["b", "a", "c"]) is None


def test_a_second_failure_with_suspects_isolates_them_and_suspects_the_rest():
    iso = PoisonIsolator()
    iso.step_failed({"a": 20, "b": 33})
    assert iso.step_failed({"b": 34, "c": 5}) is None
    assert {k: (s.reach, s.isolated, s.failures) for k, s in iso.suspects.items()} == {
        "a": (20, False, 1),
        "b": (34, True, 2),
        "c": (5, False, 1),
    }
    assert iso.alone(["c", "a", "b"]) == "b"


def test_isolated_suspects_run_one_at_a_time_in_queue_order():
    iso = PoisonIsolator()
    iso.step_failed(ids("a", "b", "c"))
    iso.step_failed(ids("a", "b", "c"))
    assert iso.alone(["c", "b", "a"]) == "c"
    assert iso.alone(["x", "b", "a"]) == "b"


def test_a_suspect_failing_alone_is_convicted_and_forgotten():
    iso = PoisonIsolator()
    iso.step_failed({"p": 12})
    assert iso.step_failed({"p": 12}) == "p"
    assert iso.suspects == {}
    # a step alone with a request that was never suspected is only a first failure
    assert iso.step_failed({"q": 3}) is None and set(iso.suspects) == {"q"}


def test_a_suspect_is_cleared_only_by_a_step_alone_that_reaches_its_failure_point():
    iso = PoisonIsolator()
    iso.step_failed({"a": 40, "b": 40})
    iso.step_failed({"a": 40, "b": 40})
    iso.step_completed({"a": 40, "b": 40})  # batched: no evidence
    iso.step_completed({"a": 32})  # alone, but a prefill chunk short of the failure point
    assert set(iso.suspects) == {"a", "b"}
    iso.step_completed({"a": 41})
    assert set(iso.suspects) == {"b"} and iso.alone(["a", "b"]) == "b"
    iso.step_completed({"b": 40})
    assert iso.suspects == {} and iso.alone(["a", "b"]) is None


def test_housekeeping_steps_and_forgotten_requests_change_nothing():
    iso = PoisonIsolator()
    assert iso.step_failed({}) is None and iso.suspects == {}
    iso.step_failed(ids("a", "b"))
    iso.step_failed(ids("a", "b"))
    iso.forget(RequestId("a"))
    assert iso.alone(["a", "b"]) == "b"
    iso.forget(RequestId("b"))
    assert iso.alone(["a", "b"]) is None


# --- the scheduler core with a crashing group -------------------------------------------------------------------


class CrashingGroup(Harness):
    """The simulated group of ``Harness``, which crashes during any step that schedules ``poison`` (from the step
    where it reaches ``at_token`` tokens on): the step's output never arrives, the core recovers, the group comes
    back empty."""

    def __init__(self, poison: str, *, at_token: int = 0, **kw) -> None:
        super().__init__("lazy", **kw)
        self.poison, self.at_token = poison, at_token
        self.crashes: list[tuple[int, list[str]]] = []  # (step id, requests scheduled)
        self.failed: dict[str, object] = {}  # request id -> its final update from recover()

    def step(self):
        plan = self.sched.schedule()
        if plan is None:
            return None
        poison = self.sched.get_request(self.poison)
        scheduled = {r.request_id: n for r, n in plan.scheduled}
        if (
            poison is not None
            and self.poison in scheduled
            and (poison.num_computed_tokens + scheduled[self.poison] >= self.at_token)
        ):
            self.crashes.append((plan.step_id, sorted(scheduled)))
            for update in self.sched.recover(reason=f"rank 1 exited during step {plan.step_id}"):
                self.failed[update.request_id] = update
            self.recoveries += 1
            self._new_ranks()
            assert self.sched.reset_group(self.group) == []
            return True
        return self.apply(plan)


def workload(h: Harness, names, max_tokens: int = 6) -> None:
    for k, name in enumerate(names):
        h.add(request(name, [text(f"{name}-prompt", 20 + 3 * k)], max_tokens=max_tokens))


def expected_tokens(name: str, k: int, max_tokens: int = 6) -> list[int]:
    prompt = 20 + 3 * k
    return [sample_token(name, prompt + i) for i in range(max_tokens)]


@pytest.mark.parametrize("at_token", [0, 26, 27])  # from its first step / at its first sample / one token later
def test_the_poison_is_found_and_only_it_fails(at_token):
    names = ["a", "b", "poison", "c"]
    h = CrashingGroup("poison", at_token=at_token)
    workload(h, names)
    h.run()
    assert set(h.failed) == {"poison"}
    update = h.failed["poison"]
    assert update.finished is FinishReason.ERROR and update.error_status is Status.INTERNAL
    assert "request poison crashed the worker group twice" in update.error
    # the cause of the last loss is named (a step deadline on a slow link reads differently from a crash)
    assert f"the group was lost: rank 1 exited during step {h.crashes[-1][0]}" in update.error
    # two failures batched, then the poison alone; each innocent one ran alone once in between (cleared)
    assert len(h.crashes) == 3
    assert h.crashes[0][1] == h.crashes[1][1] == sorted(names)
    assert h.crashes[2][1] == ["poison"]
    assert h.sched.isolator.suspects == {}
    for k, name in enumerate(names):
        if name != "poison":
            assert h.outputs[name] == expected_tokens(name, k), name
            assert h.finished[name].finished is FinishReason.LENGTH
    if at_token == 27:  # one token was generated before the first crash; it stays the poison's
        assert h.outputs["poison"] == expected_tokens("poison", 2)[:1]


def test_isolation_steps_hold_exactly_one_suspect_alone():
    h = CrashingGroup("poison", keep_plans=True)
    workload(h, ["a", "poison", "b"])
    h.run()
    # after the second crash: the steps until the third crash each schedule one request alone
    second, third = h.crashes[1][0], h.crashes[2][0]
    between = [rec for rec in h.log if second < rec.step_id < third and rec.scheduled]
    assert between and all(len(rec.scheduled) == 1 for rec in between)
    assert {next(iter(rec.scheduled)) for rec in between} == {"a"}  # "a" is first in the queue and innocent


def test_a_lone_poison_is_failed_after_two_crashes():
    h = CrashingGroup("poison")
    workload(h, ["poison"])
    h.run()
    assert set(h.failed) == {"poison"} and len(h.crashes) == 2


def test_a_rank_that_fails_on_its_own_costs_no_request():
    # One crash of the group with every request in the step (a rank died for its own reasons), then none.
    h = CrashingGroup("nobody")
    names = ["a", "b", "c"]
    workload(h, names)
    h.step()
    assert h.sched.recover() == []  # lost between steps: nothing to judge
    assert h.sched.isolator.suspects == {}
    h._new_ranks()
    assert h.sched.reset_group(h.group) == []
    plan = h.sched.schedule()
    assert plan is not None
    assert h.sched.recover() == []  # lost during this step: its requests become suspects, nobody fails
    assert set(h.sched.isolator.suspects) == set(plan.num_scheduled_tokens)
    h._new_ranks()
    assert h.sched.reset_group(h.group) == []
    h.run()
    assert h.failed == {}
    for k, name in enumerate(names):
        assert h.outputs[name] == expected_tokens(name, k)


def test_an_isolated_suspect_that_waits_behind_running_requests_preempts_them():
    # After the second crash, allow one running request: the cleared "a" keeps running, so the next isolated
    # suspect cannot be admitted beside it and the step requeues "a".
    h = CrashingGroup("poison", keep_plans=True)
    names = ["a", "poison", "b"]
    workload(h, names, max_tokens=4)
    while len(h.crashes) < 2:
        h.step()
    h.sched.config = dataclasses.replace(h.sched.config, max_num_seqs=1)
    h.run()
    assert set(h.failed) == {"poison"} and len(h.crashes) == 3
    assert any(rec.preempted == ["a"] for rec in h.log if h.crashes[1][0] < rec.step_id < h.crashes[2][0])
    for k, name in enumerate(names):
        if name != "poison":
            assert h.outputs[name] == expected_tokens(name, k, 4)


def test_a_rank_side_request_failure_is_finished_and_the_ranks_told():
    h = Harness("lazy")
    workload(h, ["a", "b"])
    plan = h.sched.schedule()
    control = step_control(plan).SerializeToString()
    sampled = {}
    for rank in h.ranks:
        got = rank.apply(control, plan.rank_payloads[rank.rank])
        sampled = got if rank.rank == 0 else sampled
    del sampled["b"]
    updates = {u.request_id: u for u in h.sched.update_from_output(plan, outcome(sampled, {"b": "logits all NaN"}))}
    assert updates["b"].finished is FinishReason.ERROR and updates["b"].error_status is Status.INTERNAL
    assert updates["b"].error == "request b failed at the worker: logits all NaN"
    assert updates["a"].new_token_ids == [sample_token("a", 20)]
    nxt = h.sched.schedule()
    assert nxt.finished_request_ids == ["b"] and list(nxt.num_scheduled_tokens) == ["a"]


def test_the_engine_fails_a_convicted_request_with_internal_a_metric_and_a_log_line(caplog):
    import asyncio
    import logging

    from scheduler_svc.engine.metrics import SchedulerMetrics
    from scheduler_svc.engine.step_loop import Engine, FinishEvent, RequestHandle

    class DownGroup:  # the group as _group_lost sees it: it only closes the streams
        async def close(self):
            pass

    h = Harness("lazy")
    metrics = SchedulerMetrics()
    engine = Engine(
        group=DownGroup(), core_factory=None, metrics=metrics, group_deadline_seconds=60, model_max_len=65536
    )
    engine.core = h.sched
    workload(h, ["poison"])
    engine.handles["poison"] = handle = RequestHandle(RequestId("poison"), 0.0)

    async def crash_twice():
        for _ in range(2):
            assert h.sched.schedule() is not None
            await engine._group_lost("rank 1 (127.0.0.1:1): stream ended: UNAVAILABLE")
            h.sched.reset_group(h.group)

    with caplog.at_level(logging.ERROR, logger="scheduler_svc.engine.step_loop"):
        asyncio.run(crash_twice())
    event = handle.events.get_nowait()
    assert isinstance(event, FinishEvent) and event.reason == "error"
    assert (
        event.error.status is Status.INTERNAL and "request poison crashed the worker group twice" in event.error.message
    )
    assert metrics.registry.get_sample_value("mmcast_poison_requests_total") == 1
    assert metrics.registry.get_sample_value("mmcast_requests_finished_total", {"reason": "error"}) == 1
    [line] = [r for r in caplog.records if r.getMessage().startswith("poison request failed")]
    assert line.request_id == "poison" and "stream ended" in line.reason
    assert engine.handles == {} and not h.sched.has_requests()


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_fail_exactly_the_poison(seed):
    """Random prompts (some with images), chunked prefill, a random poison that crashes the group from a random
    token on (or no poison at all): only the poison fails, after at most three crashes, and every other request's
    tokens are those of a clean run."""
    import random

    rng = random.Random(seed)
    names = [f"r{k}" for k in range(rng.randint(1, 6))]
    poison = rng.choice([*names, "nobody"])
    h = CrashingGroup(poison, max_batched=rng.choice([24, 48, 8192]), max_seqs=rng.choice([2, 4, 64]))
    expected = {}
    for k, name in enumerate(names):
        segments = [text(f"{name}-a", rng.randint(3, 40))]
        if rng.random() < 0.5:
            segments += [(f"img-{seed}-{k}", rng.randint(4, 20)), text(f"{name}-b", rng.randint(1, 10))]
        req = h.add(request(name, segments, max_tokens=rng.randint(1, 8)))
        expected[name] = [sample_token(name, req.num_prompt_tokens + i) for i in range(req.sampling.max_tokens)]
        if name == poison:  # a token count it computes: the last is prompt + max_tokens - 1
            h.at_token = rng.randint(0, req.num_prompt_tokens + req.sampling.max_tokens - 1)
    h.run()
    assert set(h.failed) == ({poison} if poison in names else set())
    assert len(h.crashes) <= 3 and h.sched.isolator.suspects == {}
    for name in names:
        if name != poison:
            assert h.outputs[name] == expected[name], name
            assert h.finished[name].finished is FinishReason.LENGTH
