"""The scheduler's step loop: schedule step k → write it to the group → deliver step k-1's tokens to the clients
(while the ranks compute) → wait for step k's answers → apply rank 0's tokens to the core → schedule step k+1.

Runs on the server's asyncio loop. The scheduler core is plain synchronous Python; the group is the network.
When the group is lost, the core requeues every running request (generated tokens appended, so client
streams continue without repeats), the loop reconnects with backoff, and requests still waiting when the group
has been down longer than the deadline fail with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from common import tracing
from common.errors import REQUEST_RESOURCE, MmcastError, Resource, Status, Unavailable
from common.ids import ItemId, RequestId
from common.sample import Sample
from scheduler_svc.core.inputs import GroupBudget, GroupStepOutcome
from scheduler_svc.core.request import FinishReason
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.request_handle import FinishEvent, RequestHandle
from scheduler_svc.engine.stage_timing import StepTimes
from scheduler_svc.engine.step_delivery import StepDelivery
from scheduler_svc.transport.plan_proto import late_masks_proto, step_control
from scheduler_svc.transport.rank_streams import GroupDown, PayloadTensors, WorkerGroup

log = logging.getLogger(__name__)


def _plan_attributes(plan) -> dict[str, object]:
    return {
        "step_id": plan.step_id,
        "requests": len(plan.num_scheduled_tokens),
        "new_requests": len(plan.new_requests),
        "tokens": plan.total_num_scheduled_tokens,
        "encoder_inputs": len(plan.encoder_inputs),
    }


def _step_span(plan):
    """The span of one step (broadcast, every rank's answer); the ranks' spans of it carry the same ids."""
    if not tracing.enabled():
        return tracing.span("mmcast.step")
    return tracing.span(
        "mmcast.step", request_ids=[str(r) for r in plan.num_scheduled_tokens], **_plan_attributes(plan)
    )


def _open_step_span(plan):
    """``_step_span`` for a step in flight beside another (async scheduling): begun at its send, ended at its answer."""
    if not tracing.enabled():
        return None
    return tracing.open_span(
        "mmcast.step", request_ids=[str(r) for r in plan.num_scheduled_tokens], **_plan_attributes(plan)
    )


class Engine:
    def __init__(
        self,
        *,
        group: WorkerGroup,
        core_factory: Callable[[GroupBudget], object],
        metrics: SchedulerMetrics,
        group_deadline_seconds: float,
        model_max_len: int,
        keepalive_seconds: float = 5.0,
        reconnect_backoff: tuple[float, float] = (0.2, 5.0),
        on_group_state: Callable[[bool], None] | None = None,
        async_scheduling: bool = False,
        late_masks: bool = True,
    ) -> None:
        self.group = group
        self.core_factory = core_factory
        self.core = None  # built at the first connect, from the group's budgets
        self.metrics = metrics
        self.group_deadline_seconds = group_deadline_seconds
        self.model_max_len = model_max_len  # the model config's context; the ranks may report less
        self.keepalive_seconds = keepalive_seconds
        self.backoff = reconnect_backoff
        self.on_group_state = on_group_state or (lambda up: None)
        self.async_scheduling = async_scheduling  # --async-scheduling: plain decode steps planned a step ahead
        self.late_masks = late_masks  # --async-grammar: constrained ones too, where the ranks take late masks
        self.handles: dict[RequestId, RequestHandle] = {}
        self._wake = asyncio.Event()
        self._ready = asyncio.Event()
        self._stopping = False
        self._down_since: float | None = time.monotonic()
        self._next_connect_at = time.monotonic()  # when the loop next tries to reach a group that is down
        self._task: asyncio.Task | None = None
        self.delivery = StepDelivery(metrics, self.handles)  # the handles' side of each step, run off its path
        self.last_down_reason = "not connected yet"

    # --- public API (called by the servicer on the same loop) -------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="engine")

    async def stop(self, step_grace_seconds: float = 10.0) -> None:
        """Ends the step loop at a step boundary: a step in flight completes on every rank first (up to
        ``step_grace_seconds``). Cut between its writes, one rank would hold a step its peers never get, and the
        group would have to restart before the next scheduler could use it."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), step_grace_seconds)
            except (TimeoutError, asyncio.CancelledError, Exception):
                self._task.cancel()
                try:
                    await self._task
                except (asyncio.CancelledError, Exception):
                    pass
        await self.group.close()

    async def wait_ready(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except TimeoutError:
            return False

    def submit(self, request, received_at: float | None = None) -> RequestHandle:
        """Queue a request (a core ``Request``). Raises MmcastError (ALREADY_EXISTS, RESOURCE_EXHAUSTED, ...)."""
        if self.core is None or not self._ready.is_set():
            down_for = time.monotonic() - (self._down_since or time.monotonic())
            if self.core is None or down_for > self.group_deadline_seconds:
                raise Unavailable(
                    f"worker group unavailable for {down_for:.1f}s ({self.last_down_reason}); retry later",
                    retry_after=self.reconnect_wait(),
                )
        if request.request_id in self.handles:
            raise MmcastError(
                f"request_id {request.request_id!r} is already in flight",
                Status.ALREADY_EXISTS,
                resource=Resource(REQUEST_RESOURCE, request.request_id),
            )
        self.core.add_request(request)
        handle = RequestHandle(request.request_id, time.monotonic() if received_at is None else received_at)
        self.handles[request.request_id] = handle
        self.metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        self.metrics.request_prompt_tokens.observe(len(request.prompt_token_ids))
        self.delivery.update_gauges(self.core)
        self._wake.set()
        return handle

    def finish(self, request_id: RequestId, reason: str) -> None:
        """Stop a request from the service side (stop string, client gone, deadline). Frees its blocks."""
        handle = self.handles.pop(request_id, None)
        if handle is None:
            return
        if self.core is not None:
            update = self.core.finish_request(request_id, FinishReason(reason))
            if update is not None and update.usage is not None:
                handle.usage = update.usage
        self.delivery.finish_handle(handle, FinishEvent(reason))
        self.delivery.update_gauges(self.core)
        self._wake.set()

    # --- the loop ---------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not silently stop serving: log it, recover, go on
                log.exception("step loop failed; recovering the group")
                await self._group_lost(f"step loop failed: {exc!r}")
                await asyncio.sleep(self.backoff[0])
        if self.core is not None:
            self.delivery.flush(self.core)  # the last step's tokens: stopped at a step boundary, none is lost

    async def _loop(self) -> None:
        delay = self.backoff[0]
        while not self._stopping:
            if self.group.budget is not None and not self.group.up:
                # a stream failed between steps (noticed here, not inside a step): recover like any loss
                await self._group_lost(self.group.failure or "a rank stream failed")
                continue
            if self.core is None or not self.group.up:
                if await self._connect():
                    delay = self.backoff[0]
                else:
                    self._next_connect_at = time.monotonic() + delay
                    self._fail_if_past_deadline()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, self.backoff[1])
                continue
            queued_until = time.monotonic()  # the queue stage of the requests this step first schedules ends here
            t0, t0_ns = time.perf_counter(), time.time_ns()
            plan = self.core.schedule()
            deferred = self.core.take_deferred_updates()  # live turns the step could not keep (no blocks)
            if deferred:
                self.delivery.flush(self.core)  # the previous step's tokens first: a request's updates keep order
            for update in deferred:
                self.delivery.deliver(update, time.monotonic())
            t1 = time.perf_counter()
            self.metrics.schedule_seconds.observe(t1 - t0)
            if plan is not None:
                self._mark_scheduled(plan, time.monotonic(), queued_until)
                if tracing.enabled():
                    tracing.record_span("mmcast.schedule", t0_ns, time.time_ns(), **_plan_attributes(plan))
            if plan is None:
                self.delivery.flush(self.core)
                self.delivery.update_gauges(self.core)
                self._wake.clear()
                woke = asyncio.ensure_future(self._wake.wait())
                failed = asyncio.ensure_future(self.group.any_failed.wait())
                done, _ = await asyncio.wait(
                    {woke, failed}, timeout=self.keepalive_seconds, return_when=asyncio.FIRST_COMPLETED
                )
                woke.cancel()
                failed.cancel()
                await asyncio.gather(woke, failed, return_exceptions=True)  # reap them: no pending tasks left
                if not done or failed in done:
                    try:
                        await self.group.keepalive(stale_after=2.5 * self.keepalive_seconds)
                    except GroupDown as exc:
                        await self._group_lost(str(exc))
                continue
            try:
                if self.async_scheduling and self.group.last_sampled_input:
                    await self._run_ahead(plan, t0, t1)
                    continue
                with _step_span(plan):
                    await self.group.send_step(plan.step_id, step_control(plan), self._payloads(plan))
                    # The ranks compute step k: the previous step's tokens go to the clients meanwhile (and the
                    # loop yields to client streams and new requests while it waits for the answers).
                    self.delivery.flush(self.core)
                    results = await self.group.step_results(plan.step_id)
            except GroupDown as exc:
                await self._group_lost(str(exc))
                continue
            t2 = time.perf_counter()
            self.metrics.step_seconds.observe(t2 - t0)
            sent = self.group.last_sent_at  # building, serializing and writing the step (t1 → sent), then waiting
            self._apply(plan, results, StepTimes(t1 - t0, sent - t1, t2 - sent, results))

    async def _run_ahead(self, plan, t0: float, t1: float) -> None:
        """Runs ``plan`` and the plain decode steps the core plans while each one runs (``async_steps.py``): step
        k+1 is written before step k's answer is awaited, so the ranks never wait for the scheduler between them.
        When k+1 announced late masks (constrained requests), they go to rank 0 as soon as k's answer is applied, in
        k+2's control or before anything of k+2. Returns when no step is in flight. Raises GroupDown."""
        inflight = []
        try:
            await self._send_ahead(plan, t0, t1, inflight)
            while inflight:
                if len(inflight) == 1:
                    await self._plan_ahead(inflight)
                self.delivery.flush(self.core)  # the applied steps' tokens to the clients while the ranks compute
                done, d0, d1, sent, span = inflight[0]
                results = await self.group.step_results(done.step_id)
                inflight.pop(0)
                tracing.end_span(span)
                t2 = time.perf_counter()
                self.metrics.step_seconds.observe(t2 - d0)
                self._apply(done, results, StepTimes(d1 - d0, sent - d1, t2 - sent, results))
                if inflight and inflight[0][0].masks_follow:  # its masks need the tokens just applied
                    await self._send_late_masks(inflight)
        finally:
            for *_, span in inflight:  # a group lost with steps in flight: their spans end with it
                tracing.end_span(span)

    async def _send_late_masks(self, inflight: list) -> None:
        """The late masks of the step in flight (``inflight[0]``, which announced ``masks_follow``), now that the step
        before it is applied: in the control of the next step when the core plans one ahead now (one frame to the
        ranks, as for unconstrained steps), else in a frame of their own to rank 0."""
        following = inflight[0][0]
        masks = late_masks_proto(following.step_id, self.core.late_masks(following))
        if not await self._plan_ahead(inflight, masks):
            await self.group.send_late_masks(masks)

    async def _plan_ahead(self, inflight: list, prior_masks=None) -> bool:
        """Plans the step after the one in flight (``async_steps.py``) and writes it, with ``prior_masks`` (the late
        masks of the step in flight); False when the core plans none (the step loop stops, or a rule does not hold)."""
        if self._stopping:
            return False
        a0, a0_ns = time.perf_counter(), time.time_ns()
        ahead = self.core.schedule_ahead(late_masks=self.late_masks and self.group.late_token_masks)
        if ahead is None:
            return False
        a1 = time.perf_counter()
        self.metrics.schedule_seconds.observe(a1 - a0)
        if tracing.enabled():
            tracing.record_span("mmcast.schedule", a0_ns, time.time_ns(), **_plan_attributes(ahead))
        await self._send_ahead(ahead, a0, a1, inflight, prior_masks)
        self.metrics.steps_ahead.inc()
        return True

    async def _send_ahead(self, plan, t0: float, t1: float, inflight: list, prior_masks=None) -> None:
        """Writes ``plan`` (with the late masks of the step before it, if any) and adds it to ``inflight`` with its
        times and its open span (the broadcast's parent)."""
        span = _open_step_span(plan)
        inflight.append((plan, t0, t1, None, span))
        with tracing.within(span):
            await self.group.send_step(plan.step_id, step_control(plan, prior_masks), self._payloads(plan))
        inflight[-1] = (plan, t0, t1, self.group.last_sent_at, span)

    def reconnect_wait(self) -> float:
        """Seconds until the loop next tries to reach the group (the retry hint of UNAVAILABLE while it is down): a
        request sent sooner finds the group still down."""
        return max(0.0, self._next_connect_at - time.monotonic())

    @property
    def max_model_len(self) -> int:
        """Context length requests must fit: the core's, resolved at each connect from the configured length, the
        model's and what the ranks reported; before the first connect, the configured and the model's."""
        return self.core.max_model_len if self.core is not None else self.model_max_len

    @staticmethod
    def _payloads(plan) -> list[list[PayloadTensors]]:
        out = []
        for sends in plan.rank_payloads:
            out.append(
                [
                    PayloadTensors(s.identifier, [(n, e.data) for n, e in s.feature.data.payload_fields().items()])
                    for s in sends
                ]
            )
        return out

    async def _connect(self) -> bool:
        try:
            budget = await self.group.connect()
        except GroupDown as exc:
            self.last_down_reason = str(exc)
            log.warning("worker group not available: %s", exc)
            return False
        if self.core is None:
            self.core = self.core_factory(budget)
            self.delivery.reset_stats(self.core)
        else:
            for update in self.core.reset_group(budget):  # requests that no longer fit the new budgets
                self.delivery.deliver(update, time.monotonic())
        self.metrics.kv_blocks_total.set(budget.kv_blocks)
        self.metrics.group_up.set(1)
        self._down_since = None
        self._ready.set()
        self.on_group_state(True)
        self._wake.set()
        return True

    async def _group_lost(self, reason: str) -> None:
        log.error("worker group lost: %s", reason)
        if self.core is not None:
            self.delivery.flush(self.core)  # the last applied step's tokens, before anything the recovery says
        # Not ready from this moment: readiness and the gauges must not wait for the streams to close.
        self.last_down_reason = reason
        self.metrics.group_up.set(0)
        self.metrics.group_recoveries.inc()
        self._ready.clear()
        self.on_group_state(False)
        self._down_since = time.monotonic()
        # Close every stream, healthy or not: a rank that missed a deadline or a keepalive may still be running
        # the lost step, and only a reconnect under a newer epoch makes the ranks drop that stream's state. Left
        # open, the next (recovered) step would go to ranks still holding the old requests.
        await self.group.close()
        if self.core is not None:
            for update in self.core.recover(reason):  # a request convicted of crashing the group: it fails alone
                self.metrics.poison_requests.inc()
                log.error(
                    "poison request failed: it crashed the worker group twice",
                    extra={"request_id": update.request_id, "reason": reason},
                )
                self.delivery.deliver(update, time.monotonic())
        self.delivery.update_gauges(self.core)

    def _fail_if_past_deadline(self) -> None:
        if self._down_since is None or self.core is None:
            return
        down_for = time.monotonic() - self._down_since
        if down_for <= self.group_deadline_seconds or not self.handles:
            return
        err = Unavailable(
            f"worker group down for {down_for:.1f}s, past --group-deadline-seconds={self.group_deadline_seconds:g} "
            f"({self.last_down_reason})",
            retry_after=self.reconnect_wait(),
        )
        for request_id, handle in list(self.handles.items()):
            self.core.finish_request(request_id, FinishReason.ERROR, error=err.message)
            self.delivery.finish_handle(handle, FinishEvent("error", err))
        self.delivery.update_gauges(self.core)

    def _apply(self, plan, results, times: StepTimes | None = None) -> None:
        """Applies rank 0's answer to the core (what the next schedule needs) and defers the rest."""
        rank0 = results[0]
        outcome = GroupStepOutcome(
            sampled={
                RequestId(s.request_id): Sample(
                    s.token_id, s.logprob, [(t.token_id, t.logprob) for t in s.top_logprobs]
                )
                for s in rank0.sampled
            },
            failed={RequestId(f.request_id): f.message for f in rank0.failures},
            # Items an owner rank could not decode (encoded payloads): every rank skipped the windows reaching them.
            item_failures={ItemId(f.item_identifier): f.message for r in results for f in r.item_failures},
            # the slowest rank's clocks: what the step's work cost (the stall bound's rates, step_costs.py)
            step_seconds=max(r.stats.step_time.ToNanoseconds() for r in results) / 1e9,
            encoder_seconds=max(r.stats.encoder_time.ToNanoseconds() for r in results) / 1e9,
        )
        for request_id, message in outcome.failed.items():
            log.warning("request failed at the worker", extra={"request_id": request_id, "reason": message})
        for ident, message in outcome.item_failures.items():
            log.warning("image failed at its owner rank", extra={"item": ident[:16], "reason": message})
        self.delivery.defer(plan, self.core.update_from_output(plan, outcome), times)

    def _mark_scheduled(self, plan, now: float, queued_until: float) -> None:
        """Ends the queue time of the requests this step schedules for the first time (a resumed one keeps its
        first). ``queued_until``: when this step's ``schedule()`` began, the end of the queue stage."""
        for request_id in plan.num_scheduled_tokens:
            handle = self.handles.get(request_id)
            if handle is not None and handle.first_scheduled_at is None:
                handle.first_scheduled_at = now
                handle.stages.queue = queued_until - handle.submitted_at
                self.metrics.queue_seconds.observe(now - handle.received_at)
