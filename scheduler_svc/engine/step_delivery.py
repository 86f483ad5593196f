"""A step's results after the core has applied them: tokens and ends to the requests' handles, and the metrics.

None of it is needed to schedule the next step, so the step loop defers it (``defer``) and runs it (``flush``)
after the next step is written to the ranks, while they compute it. A request's updates keep their order: the
loop flushes before it delivers anything else (updates from ``schedule``, a recovery, a service-side finish all
come after the step whose tokens are pending).
"""

from __future__ import annotations

import time

from common.errors import MmcastError, Status
from common.ids import RequestId
from scheduler_svc.core.accounting_events import Disposition, ItemAccounting
from scheduler_svc.core.request import FinishReason
from scheduler_svc.engine.metrics import SchedulerMetrics
from scheduler_svc.engine.request_handle import FinishEvent, RequestHandle, TokenEvent
from scheduler_svc.engine.stage_timing import StepTimes

_NONE = ItemAccounting()  # a step that delivered, released and encoded no item
GAUGE_INTERVAL_SECONDS = 0.05  # per-step gauge refreshes at most this often; an idle loop refreshes them at once


class StepDelivery:
    """Owns the handles' side of the engine's steps; ``core`` is read at flush time (the engine may rebuild it)."""

    def __init__(self, metrics: SchedulerMetrics, handles: dict[RequestId, RequestHandle]) -> None:
        self.metrics = metrics
        self.handles = handles
        self._pending: list[tuple[object, list, StepTimes | None, float]] = []  # (plan, updates, times, applied at)
        self._stats_seen = None  # the core's stats at the previous count (its counters are cumulative)
        self._series_made = False  # the item series exist at 0 (the first plan counted makes them)
        self._gauges_at = 0.0  # perf_counter() of the latest gauge refresh

    def reset_stats(self, core) -> None:
        self._stats_seen = core.stats

    def defer(self, plan, updates: list, times: StepTimes | None) -> None:
        self._pending.append((plan, updates, times, time.monotonic()))

    def flush(self, core) -> None:
        """Delivers every deferred step's updates, counts their plans, refreshes the gauges (at most so often)."""
        pending, self._pending = self._pending, []
        for plan, updates, times, _applied_at in pending:
            now = time.monotonic()
            self.count_plan(plan, core)
            for update in updates:
                self.deliver(update, now, times)
            for request_id in plan.accounting:
                handle = self.handles.get(request_id)
                request = core.get_request(request_id) if handle is not None else None
                if request is not None:
                    handle.usage = request.usage
        if pending:
            self.update_gauges(core, force=False)

    def deliver(self, update, now: float, times: StepTimes | None = None) -> None:
        """``times``: the step that produced the update (None for updates from outside a step)."""
        handle = self.handles.get(update.request_id)
        if handle is None:
            return  # finished meanwhile (stop string, client gone): a token of a step already in flight is dropped
        if update.usage is not None:
            handle.usage = update.usage
        if update.new_token_ids:
            if handle.first_token_at is None:
                handle.first_token_at = now
                handle.stages.first_token_step = times
                self.metrics.ttft.observe(now - handle.received_at)
            else:
                self.metrics.inter_token_seconds.observe(now - handle.last_token_at)
            handle.last_token_at = now
            handle.generated_tokens += len(update.new_token_ids)
            self.metrics.generation_tokens.inc(len(update.new_token_ids))
            handle.events.put_nowait(TokenEvent(list(update.new_token_ids), list(update.logprobs or [])))
        if update.finished is not None:
            error = None
            if update.finished is FinishReason.ERROR:
                status = update.error_status or (Status.UNAVAILABLE if update.error else Status.INTERNAL)
                error = MmcastError(update.error or "request failed", status, field=update.error_field)
            self.finish_handle(handle, FinishEvent(update.finished.value, error))

    def finish_handle(self, handle: RequestHandle, event: FinishEvent) -> None:
        if handle.finished:
            return
        handle.finished = True
        handle.events.put_nowait(event)
        m = self.metrics
        m.requests_finished.labels(event.reason).inc()
        m.e2e_seconds.observe(time.monotonic() - handle.received_at)
        m.request_generation_tokens.observe(handle.generated_tokens)
        self.handles.pop(handle.request_id, None)

    def count_plan(self, plan, core) -> None:
        """Per-step item dispositions and saved bytes, and the core's cumulative counters as deltas."""
        m = self.metrics
        totals = plan.totals()
        quiet = not plan.encoder_inputs and totals == _NONE  # a plain decode step: no item moved, nothing encoded
        if not quiet or not self._series_made:  # (the first step counted makes the item series, at 0)
            self._series_made = True
            video = plan.video_totals.by_disposition()
            for (disposition, items, nbytes, saved_reason), (_, v_items, v_bytes, _) in zip(
                totals.by_disposition(), video, strict=True
            ):
                for modality, n, b in (("image", items - v_items, nbytes - v_bytes), ("video", v_items, v_bytes)):
                    if n or (modality == "image" and disposition is not Disposition.ABANDONED):
                        m.mm_items.labels(disposition.value, modality).inc(n)  # abandoned and video: from the first
                    if saved_reason is not None and (b or modality == "image"):
                        m.payload_bytes_saved.labels(saved_reason, modality).inc(b)
            m.encoder_items.inc(len(plan.encoder_inputs))
            m.encoder_runs.inc(totals.encoder_runs)
            m.encoder_output_shared_bytes.inc(totals.encoder_output_bytes_shared)
        if plan.stall_bounded:
            m.steps_stall_bounded.inc()
        stats, seen = core.stats, self._stats_seen
        if seen is not None:
            m.prefix_query_tokens.inc(max(0, stats.prefix_query_tokens - seen.prefix_query_tokens))
            m.prefix_hit_tokens.inc(max(0, stats.prefix_hit_tokens - seen.prefix_hit_tokens))
            m.preemptions.inc(max(0, stats.preemptions - seen.preemptions))
        self._stats_seen = stats

    def update_gauges(self, core, force: bool = True) -> None:
        if core is None:
            return
        now = time.perf_counter()
        if not force and now - self._gauges_at < GAUGE_INTERVAL_SECONDS:
            return
        self._gauges_at = now
        stats = core.stats
        self.metrics.requests_running.set(stats.num_running)
        self.metrics.requests_waiting.set(stats.num_waiting)
        self.metrics.kv_blocks_used.set(stats.kv_blocks_used)
        for part, seconds in core.costs.estimates().items():
            if seconds is not None:
                self.metrics.step_cost.labels(part).set(seconds)
        if stats.kv_blocks_total:
            self.metrics.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total)
            self.metrics.set_cache_config(core.config.block_size, stats.kv_blocks_total)
