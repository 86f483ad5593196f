"""The scheduler core: continuous batching, chunked prefill, prefix caching, preemption, recovery, and the
per-step transfer decisions — as plain Python, without any network.

The service drives it (all calls from one thread or event loop)::

    sched = Scheduler(config, GroupBudget(num_ranks, kv_blocks, encoder_cache_tokens, payload_cache_bytes),
                      uses_mrope=True, eos_token_ids={...}, max_model_len=frontend.max_model_len)
    sched.add_request(request)        # AlreadyExists | ResourceExhausted | InvalidArgument
    plan = sched.schedule()           # StepPlan, or None when there is nothing to tell the ranks
    # ... the shell maps the plan to protobuf (plan_proto.step_control): rank r gets plan.rank_payloads[r]
    # frames, then the control; it waits for every rank's StepResult and maps them back to plain data ...
    updates = sched.update_from_output(plan, GroupStepOutcome(sampled={request_id: Sample(token_id, logprob, top_logprobs)},
                                                         failed={request_id: message}))  # rank 0's failures
    #   -> [RequestUpdate]; raises StepOutputError (a FailedPrecondition: recover the group) on a mismatch
    sched.finish_request(request_id, FinishReason.CANCELLED)   # -> final RequestUpdate | None; next plan tells ranks
    poisoned = sched.recover()                                  # group lost: caches gone, running -> waiting as new;
                                                                #    -> [RequestUpdate] (ERROR) of a convicted poison
    failed = sched.reset_group(new_budget)                      # after reconnect; -> [RequestUpdate] (ERROR) that
                                                                #    no longer fit the new budgets
    sched.stats                                                 # SchedulerStats for the gauges

Steps are synchronous: ``schedule`` may not be called again before ``update_from_output`` of its plan (or
``recover``). A request samples in a step iff its scheduled tokens reach the end of its known tokens; a decode
step schedules the one token rank 0 sampled in the previous step.

Step rules, in order:
- running requests first, oldest first: as many of their uncomputed tokens as the token budget leaves, cut before
  an item whose encoder work cannot be scheduled (encoder budget, encoder cache or lazy payload room); out of KV
  blocks -> preempt the newest running request (recompute: free blocks, requeue at the front as new), repeat;
- while any request decodes, each prefill window (running or admitted) of a request queued after a decode began
  is also cut to the time the stall bound leaves (``step_costs.py``, ``--max-decode-stall-ms``), the step's first
  one never below a block;
- then, only if nothing was preempted, waiting requests in order (FCFS: the first that cannot be admitted stops
  admission) while ``max_num_seqs`` allows: prefix hit, window, full/strip payload room, blocks;
- a step that computes nothing is still produced when the ranks must be told something (finishes, evictions, a
  reset); ``None`` means nothing at all;
- poison isolation (``scheduler_svc/core/poison.py``) overrides both while a suspect is isolated: the step runs that
  request alone (the others hold their blocks, nothing else is admitted); if it cannot be scheduled beside the
  running requests, the step preempts them all so it runs alone next.
"""

from __future__ import annotations

import collections
import dataclasses

from common.errors import (
    REQUEST_RESOURCE,
    RETRY_LATER_SECONDS,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    Resource,
    ResourceExhausted,
    Status,
)
from common.ids import RequestId
from scheduler_svc.config import SchedulerConfig, context_length
from scheduler_svc.core import admission
from scheduler_svc.core.async_steps import late_masks, plan_ahead
from scheduler_svc.core.group_fit import check_fits_group
from scheduler_svc.core.inputs import GroupBudget, GroupStepOutcome
from scheduler_svc.core.kv_cache import KVCacheManager
from scheduler_svc.core.live_sessions import LiveSessions
from scheduler_svc.core.poison import PoisonIsolator
from scheduler_svc.core.recovery import recover, reset_group
from scheduler_svc.core.request import FinishReason, Request, RequestStatus, validate_sampling
from scheduler_svc.core.step_costs import StepCosts, is_decode
from scheduler_svc.core.step_draft import StepDraft, assemble_plan
from scheduler_svc.core.step_plan import RequestUpdate, StepPlan
from scheduler_svc.core.step_results import StepOutputError, apply_outcome
from scheduler_svc.core.step_windows import clear_for_suspect, schedule_running
from scheduler_svc.core.transfer import TransferDecider
from scheduler_svc.core.waiting_admission import admit_waiting

__all__ = ["Scheduler", "SchedulerStats", "StepOutputError"]


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    num_running: int  # requests the ranks hold
    num_waiting: int  # requests queued (new, preempted or requeued by a recovery)
    kv_blocks_used: int  # blocks held by requests
    kv_blocks_total: int  # blocks in the group's pool (blocks)
    preemptions: int  # preemptions since start (recoveries not included)
    prefix_query_tokens: int  # tokens looked up in the prefix cache at admissions
    prefix_hit_tokens: int  # of which hit
    encoder_cache_tokens_used: int  # mirror of the ranks' encoder caches
    payload_cache_bytes_used: int  # mirror of rank 0's payload cache
    steps: int  # plans produced


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        group: GroupBudget,
        uses_mrope: bool,
        eos_token_ids,
        *,
        max_model_len: int | None = None,
        kv_events=None,
    ) -> None:
        self.config = config
        self.kv_events = kv_events  # kv_events.KVEventSink or None: every prefix-cache change, for outside pickers
        self.uses_mrope = uses_mrope
        self.eos_token_ids = frozenset(eos_token_ids)
        self._model_max_len = max_model_len
        self._requests: dict[RequestId, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self._pending_finished: list[RequestId] = []
        self._reset_next = True  # the first plan of a scheduler (epoch) starts the ranks from empty caches
        self._next_step_id = 1
        self._outstanding: StepPlan | None = None
        self._ahead: StepPlan | None = None  # async scheduling: the step planned while _outstanding runs
        self.num_preemptions = 0
        self.isolator = PoisonIsolator()
        self._deferred: list[RequestUpdate] = []  # live turns failed inside schedule(): take_deferred_updates()
        self.live: LiveSessions | None = None
        # the measured costs of prefill and encoder work, and the stall bound (kept across reconnects)
        self.costs = StepCosts(config.max_decode_stall_ms / 1e3)
        self.steps_applied = 0  # step outcomes applied: the clock of Request.queued_at_step, first_token_at_step
        self._apply_group(group)

    def _apply_group(self, group: GroupBudget) -> None:
        cfg = self.config
        if group.num_ranks < 1:
            raise ValueError(f"num_ranks={group.num_ranks} must be >= 1")
        self.group = group
        self.kv_blocks = cfg.effective(cfg.kv_blocks, group.kv_blocks, "kv_blocks")
        self.encoder_cache_tokens = cfg.effective(
            cfg.encoder_cache_tokens, group.encoder_cache_tokens, "encoder_cache_tokens"
        )
        self.payload_cache_bytes = cfg.effective(
            cfg.payload_cache_bytes, group.payload_cache_bytes, "payload_cache_bytes"
        )
        # The one resolution at connect: the service reads it back (Engine.max_model_len).
        self.max_model_len = context_length(cfg.max_model_len, self._model_max_len or 0, group.max_model_len)
        if not self.max_model_len:
            raise ValueError("max_model_len is unknown: set --max-model-len or pass the model config's")
        old = getattr(self, "kv", None)
        self.kv = KVCacheManager(self.kv_blocks, cfg.block_size, events=self.kv_events)
        if old is not None:  # the counters are cumulative across reconnects
            self.kv.query_tokens, self.kv.hit_tokens = old.query_tokens, old.hit_tokens
        if self.live is not None:
            self.live.drop_all(free=False)  # their blocks were in the old pool
        self.live = LiveSessions(
            self.kv,
            max_sessions=cfg.max_live_sessions,
            idle_seconds=cfg.live_session_idle_seconds,
            max_turns=cfg.max_live_turns,
            max_positions=self.max_model_len,
        )
        self.decider = TransferDecider(
            cfg.transfer_mode,
            self.uses_mrope,
            group.num_ranks,
            self.payload_cache_bytes,
            self.encoder_cache_tokens,
            placement=cfg.encoder_placement,
            encoder_row_bytes=group.encoder_row_bytes,
            step_encoder_tokens=cfg.max_num_encoder_tokens,
        )

    # --- requests in ------------------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queues a request. Raises AlreadyExists, ResourceExhausted or InvalidArgument (nothing is kept then)."""
        rid = request.request_id
        if not rid:
            raise InvalidArgument("request_id is empty", field="request_id")
        if rid in self._requests:
            raise AlreadyExists(
                f"request_id={rid!r} is already in flight; ids must be unique among in-flight requests",
                resource=Resource(REQUEST_RESOURCE, rid),
            )
        if len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(
                f"the waiting queue is full ({len(self.waiting)} requests, --max-waiting={self.config.max_waiting}); "
                "retry later",
                retry_after=RETRY_LATER_SECONDS,
            )
        if not request.prompt_token_ids:
            raise InvalidArgument("the prompt is empty: at least one token is needed", field="messages")
        admission.check_core_fits(request.num_tokens, self.max_model_len)  # a defence: the service checked it
        validate_sampling(
            request.sampling,
            request.num_tokens,
            self.max_model_len,
            max_tokens_limit=self.config.max_tokens_limit,
            max_logprobs=self.config.max_logprobs,
        )
        self._check_fits_group(request)
        self._requests[rid] = request
        request.queued_at_step = self.steps_applied
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _check_fits_group(self, request: Request) -> None:
        check_fits_group(self, request)

    def get_request(self, request_id: RequestId | str) -> Request | None:
        return self._requests.get(RequestId(request_id))

    def has_requests(self) -> bool:
        return bool(self._requests)

    # --- one step -----------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """The next step, in phases: the running requests' windows, then (unless one was preempted) admission of
        the waiting ones, then room for an isolated suspect; None when the ranks need to hear nothing."""
        if self._outstanding is not None:
            raise FailedPrecondition(
                f"step {self._outstanding.step_id} is still in flight: call update_from_output() or recover() first"
            )
        self.live.expire()
        self.decider.begin_step()
        finished_ids, self._pending_finished = self._pending_finished, []
        alone = self.isolator.alone(r.request_id for r in (*self.running, *self.waiting))
        draft = StepDraft(budget=self.config.max_num_batched_tokens, alone=alone, finished_ids=finished_ids)
        began = [r.first_token_at_step for r in self.running if is_decode(r)]
        if alone is None and began:  # requests decode: prefill queued since the first began is bounded in time too
            draft.work_s, draft.decoding_since = self.costs.work_budget(), min(began)
        schedule_running(self, draft)
        draft.finished_ids += draft.preempted
        if not draft.preempted:
            admit_waiting(self, draft)
        if alone is not None and not draft.scheduled:
            clear_for_suspect(self, draft)
        self.decider.finish_step()
        return assemble_plan(self, draft)

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: free everything, requeue at the front; it is resumed as a new request. A live turn
        cannot be recomputed (its session's evicted KV is gone): it fails, and its session closes."""
        if request.live is not None:
            self._fail_live(request, "the KV pool ran out of blocks", Status.RESOURCE_EXHAUSTED, told=False)
            return
        self.decider.release(request, ended=False)
        self.kv.free(request.request_id)
        request.reset_progress()
        request.status = RequestStatus.WAITING
        request.usage.preemptions += 1
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _fail_live(self, r: Request, why: str, status: Status, *, told: bool) -> RequestUpdate:
        """Ends a live turn that cannot go on (out of blocks, group lost): ERROR, its session closed. ``told``:
        the caller does not already tell the ranks to drop it."""
        if r.status is RequestStatus.RUNNING:
            self.decider.release(r)
        self.kv.free(r.request_id)
        if r in self.running:
            self.running.remove(r)
        if told:
            self._pending_finished.append(r.request_id)
        r.status, r.finish_reason = RequestStatus.FINISHED, FinishReason.ERROR
        self._requests.pop(r.request_id, None)
        self.isolator.forget(r.request_id)
        self.live.finish(r, ok=False)
        update = RequestUpdate(
            r.request_id,
            [],
            None,
            finished=FinishReason.ERROR,
            usage=r.usage,
            error=f"live session {r.live.session.key[1]!r} closed: {why}; a live turn is not recomputed",
            error_status=status,
        )
        self._deferred.append(update)
        return update

    def schedule_ahead(self, late_masks: bool = False) -> StepPlan | None:
        """The step after the one in flight, planned before its tokens are known (``async_steps.py``), or None.
        ``late_masks``: the group takes a step's masks after its control, so constrained requests may be planned
        (their masks: ``late_masks`` once the step in flight is applied)."""
        return plan_ahead(self, late_masks)

    def late_masks(self, plan: StepPlan) -> dict[RequestId, bytes]:
        """The token masks ``plan`` (a step planned ahead) announced in ``masks_follow``, once the step before it
        was applied: request -> allowed tokens, for rank 0 (the next control's prior_masks, or a LateTokenMasks
        frame; ``async_steps.py``)."""
        return late_masks(self, plan)

    def take_deferred_updates(self) -> list[RequestUpdate]:
        """Final updates of live turns that ``schedule`` failed (call after it; the engine delivers them)."""
        out, self._deferred = self._deferred, []
        return out

    # --- results in ---------------------------------------------------------------------------------------------
    def update_from_output(self, plan: StepPlan, outcome: GroupStepOutcome) -> list[RequestUpdate]:
        """Applies a finished step: computed tokens, new cached blocks, rank 0's sampled tokens, stop checks.

        ``outcome.sampled``: rank 0's token of every request whose window reached its end. ``outcome.failed``:
        requests rank 0 could not sample; they finish with ERROR (INTERNAL) and the next plan tells the ranks to drop
        them. ``outcome.item_failures``: encoded images an owner rank could not decode; every request holding one
        finishes with ERROR (INVALID_ARGUMENT naming the image), without the step's progress (the ranks skipped the
        windows reaching it, so none of its blocks enters the prefix cache). Raises StepOutputError (changing
        nothing) when the results do not match the plan (``step_results.py``).
        """
        return apply_outcome(self, plan, outcome)

    def _finish(self, r: Request, reason: FinishReason) -> None:
        self.decider.release(r)  # what it abandons goes to its Usage
        if r.live is not None:  # before its blocks are freed: the session takes them over
            self.live.finish(r, ok=reason in (FinishReason.STOP, FinishReason.LENGTH))
        self.kv.free(r.request_id)
        self.running.remove(r)
        self._pending_finished.append(r.request_id)
        r.status, r.finish_reason = RequestStatus.FINISHED, reason
        del self._requests[r.request_id]
        self.isolator.forget(r.request_id)

    def finish_request(
        self, request_id: RequestId | str, reason: FinishReason = FinishReason.CANCELLED, error: str | None = None
    ) -> RequestUpdate | None:
        """Service-side end (stop string, cancellation, deadline): frees everything; the next plan tells the
        ranks. Returns the final update, or None when the id is not in flight."""
        reason = FinishReason(reason)  # also accepts its value: "stop", "length", "cancelled", "error"
        r = self._requests.get(RequestId(request_id))
        if r is None:
            return None
        if r.status is RequestStatus.RUNNING:
            self._finish(r, reason)
        else:
            self.waiting.remove(r)
            r.status, r.finish_reason = RequestStatus.FINISHED, reason
            del self._requests[r.request_id]
            self.isolator.forget(r.request_id)
            if r.live is not None:
                self.live.finish(r, ok=False)  # never admitted: the session is as before
        return RequestUpdate(r.request_id, [], None, finished=reason, usage=r.usage, error=error)

    # --- group loss -------------------------------------------------------------------------------------------
    def recover(self, reason: str = "") -> list[RequestUpdate]:
        """The group was lost (``reason``: why; a convicted request's error names it): every cache is gone.
        Running requests go back to the front of the queue, in order, as new requests whose prompt includes the
        tokens generated so far; the step in flight is void (``recovery.py``).

        When the loss happened during a step, poison isolation judges its requests (``scheduler_svc/core/poison.py``);
        a request convicted of crashing the group is failed instead of requeued: its final update (ERROR,
        INTERNAL) is returned."""
        return recover(self, reason)

    def reset_group(self, group: GroupBudget) -> list[RequestUpdate]:
        """New budgets after a reconnect (call ``recover`` first). Waiting requests that no longer fit fail with
        ERROR; their final updates are returned."""
        return reset_group(self, group)

    @property
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            preemptions=self.num_preemptions,
            prefix_query_tokens=self.kv.query_tokens,
            prefix_hit_tokens=self.kv.hit_tokens,
            encoder_cache_tokens_used=self.decider.mirrors.encoder.used,
            payload_cache_bytes_used=self.decider.mirrors.payloads[0].used,
            steps=self._next_step_id - 1,
        )
