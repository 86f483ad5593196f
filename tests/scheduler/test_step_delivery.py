"""The step loop's deferred half (``scheduler_svc/engine/step_delivery.py``) on a real core, without a server: a step's
updates reach the handles only at ``flush``, in order, and a request finished while its next step was in flight
gets nothing of that step (no token, no count), while its blocks are already free."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from common.ids import RequestId
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.inputs import GroupBudget
from scheduler_svc.core.request import FinishReason, Request, RequestSampling
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.request_handle import FinishEvent, RequestHandle, TokenEvent
from scheduler_svc.engine.step_delivery import StepDelivery
from tests.support.sched_sim import EOS, outcome

GROUP = GroupBudget(num_ranks=1, kv_blocks=64, encoder_cache_tokens=64, payload_cache_bytes=2048)


def setup(*rids: str, max_tokens: int = 3):
    core = Scheduler(SchedulerConfig(max_model_len=512), GROUP, uses_mrope=True, eos_token_ids={EOS})
    handles: dict[RequestId, RequestHandle] = {}
    delivery = StepDelivery(SchedulerMetrics(CollectorRegistry()), handles)
    delivery.reset_stats(core)
    for rid in rids:
        core.add_request(Request(rid, list(range(1, 11)), [], RequestSampling(max_tokens=max_tokens)))
        handles[RequestId(rid)] = RequestHandle(RequestId(rid), 0.0)
    return core, handles, delivery


def events(handle: RequestHandle) -> list:
    out = []
    while not handle.events.empty():
        out.append(handle.events.get_nowait())
    return out


def run_step(core, delivery, tokens: dict[str, int]):
    plan = core.schedule()
    delivery.defer(plan, core.update_from_output(plan, outcome({r: t for r, t in tokens.items()})), None)
    return plan


def test_tokens_wait_for_flush_and_keep_their_order():
    async def main():
        core, handles, delivery = setup("a")
        handle = handles[RequestId("a")]
        run_step(core, delivery, {"a": 7})
        run_step(core, delivery, {"a": 8})
        assert events(handle) == []  # applied to the core, not delivered yet
        assert core.get_request("a").output_token_ids == [7, 8]
        delivery.flush(core)
        got = events(handle)
        assert [e.token_ids for e in got] == [[7], [8]] and handle.generated_tokens == 2
        run_step(core, delivery, {"a": 9})  # max_tokens: the core ends it
        delivery.flush(core)
        last = events(handle)
        assert isinstance(last[0], TokenEvent) and last[0].token_ids == [9]
        assert isinstance(last[1], FinishEvent) and last[1].reason == "length"
        assert RequestId("a") not in handles

    asyncio.run(main())


def test_a_request_finished_while_its_next_step_runs_gets_nothing_of_that_step():
    async def main():
        core, handles, delivery = setup("a", "b", max_tokens=8)
        run_step(core, delivery, {"a": 7, "b": 5})
        plan = core.schedule()  # the next step is on the ranks ...
        delivery.flush(core)  # ... while the previous step's tokens reach the clients
        # The request path finds a stop string in "a"'s text: it ends "a" (as Engine.finish does).
        handle = handles.pop(RequestId("a"))
        core.finish_request("a", FinishReason.STOP)
        delivery.finish_handle(handle, FinishEvent("stop"))
        assert core.stats.num_running == 1
        delivery.defer(plan, core.update_from_output(plan, outcome({"b": 6})), None)  # "a"'s token: dropped
        delivery.flush(core)
        got = events(handle)
        assert [e.token_ids for e in got if isinstance(e, TokenEvent)] == [[7]]
        assert handle.generated_tokens == 1 and got[-1].reason == "stop"
        assert core.schedule().finished_request_ids == ["a"]  # the ranks drop it with the next step

    asyncio.run(main())


def test_gauges_refresh_at_most_every_interval_unless_forced():
    async def main():
        core, handles, delivery = setup("a", "b", max_tokens=8)

        def running() -> float:
            return delivery.metrics.registry.get_sample_value("mmcast_requests_running")

        delivery.update_gauges(core)  # forced: both waiting
        run_step(core, delivery, {"a": 7, "b": 5})
        delivery.flush(core)  # within the interval of the forced refresh: skipped
        assert running() == 0
        delivery.update_gauges(core, force=True)
        assert running() == 2

    asyncio.run(main())


def test_a_group_lost_with_tokens_pending_delivers_them_and_requeues_them_in_the_prompt():
    """The group is lost right after a step was applied (its tokens not yet delivered): the client gets the token
    once, and the recovered request carries it in its prompt, so the stream continues without a repeat or a gap."""
    from scheduler_svc.engine.step_loop import Engine

    class DownGroup:  # the group as _group_lost sees it: it only closes the streams
        async def close(self):
            pass

    async def main():
        core, handles, _ = setup("a", max_tokens=8)
        engine = Engine(
            group=DownGroup(),
            core_factory=None,
            metrics=SchedulerMetrics(CollectorRegistry()),
            group_deadline_seconds=60,
            model_max_len=512,
        )
        engine.core, engine.handles = core, handles
        engine.delivery = StepDelivery(engine.metrics, handles)
        handle = handles[RequestId("a")]
        run_step(core, engine.delivery, {"a": 7})
        run_step(core, engine.delivery, {"a": 8})
        await engine._group_lost("rank 0 (127.0.0.1:1): stream ended")
        assert [e.token_ids for e in events(handle)] == [[7], [8]]
        core.reset_group(GROUP)
        [resumed] = core.schedule().new_requests
        assert resumed.prompt_token_ids[-2:] == [7, 8] and resumed.num_output_tokens == 2

    asyncio.run(main())
