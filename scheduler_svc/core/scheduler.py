"""The scheduler core: continuous batching, chunked prefill, prefix caching, preemption, recovery, and the
per-step transfer decisions — as plain Python, without any network.

The service drives it (all calls from one thread or event loop)::

    sched = Scheduler(config, GroupBudget(num_ranks, kv_blocks, encoder_cache_tokens, payload_cache_bytes),
                      uses_mrope=True, eos_token_ids={...}, max_model_len=frontend.max_model_len)
    sched.add_request(request)        # AlreadyExists | ResourceExhausted | InvalidArgument
    plan = sched.schedule()           # StepPlan, or None when there is nothing to tell the ranks
    # ... the shell maps the plan to protobuf (plan_proto.step_control): rank r gets plan.rank_payloads[r]
    # frames, then the control; it waits for every rank's StepResult and maps them back to plain data ...
    updates = sched.update_from_output(plan, GroupStepOutcome(sampled={request_id: Sample(token_id, logprob, top)},
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
from collections.abc import Mapping

from common.errors import (
    REQUEST_RESOURCE,
    RETRY_LATER_SECONDS,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    MmcastError,
    Resource,
    ResourceExhausted,
    Status,
)
from common.ids import ItemId, RequestId
from scheduler_svc.config import SchedulerConfig, context_length
from scheduler_svc.core import admission
from scheduler_svc.core.async_steps import plan_ahead
from scheduler_svc.core.inputs import GroupBudget, GroupStepOutcome
from scheduler_svc.core.kv_cache import KVCacheManager
from scheduler_svc.core.live_sessions import LiveSessions
from scheduler_svc.core.poison import PoisonIsolator
from scheduler_svc.core.request import FinishReason, Request, RequestStatus, validate_sampling
from scheduler_svc.core.step_plan import NewRequestData, RequestUpdate, RunningRequestData, StepPlan, payload_nbytes
from scheduler_svc.core.structured_output import grammar_verdict, step_masks
from scheduler_svc.core.transfer import TransferDecider


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


class StepOutputError(FailedPrecondition):
    """Rank 0's sampled tokens do not match the plan (missing or unexpected); the group must be recovered."""


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
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def _check_fits_group(self, request: Request) -> None:
        """Whatever the load, the request must fit the group's pools on its own (else it would wait forever)."""
        capacity = self.kv_blocks * self.config.block_size
        need = request.num_prompt_tokens + request.sampling.max_tokens
        if need > capacity:
            raise ResourceExhausted(
                f"prompt ({request.num_prompt_tokens} tokens) + sampling.max_tokens ({request.sampling.max_tokens}) "
                f"= {need} tokens exceeds the KV pool of {capacity} tokens ({self.kv_blocks} blocks of "
                f"{self.config.block_size}; --kv-blocks / the workers' pool)",
                field=("messages", "sampling.max_tokens"),  # over the pool whatever the load: no retry hint
            )
        prev_end = 0
        unique: dict[str, int] = {}
        for k, f in enumerate(request.mm_features):
            pos, where = f.mm_position, f"image {k} (item {f.identifier[:16]})"
            field = request.image_fields[k] if k < len(request.image_fields) else "messages"
            if pos.length < 1 or pos.offset < prev_end or pos.end > request.num_prompt_tokens:
                raise InvalidArgument(
                    f"{where}: placeholder [{pos.offset}, {pos.end}) must be non-empty, after the previous item "
                    f"(ends at {prev_end}) and inside the prompt ({request.num_prompt_tokens} tokens)",
                    field=field,
                )
            prev_end = pos.end
            if f.data is None or not f.data.payload_fields():
                raise InvalidArgument(
                    f"{where} has no payload; the scheduler's copy must keep every item's data", field=field
                )
            if pos.get_num_embeds() > self.encoder_cache_tokens:
                raise ResourceExhausted(
                    f"{where} needs {pos.get_num_embeds()} encoder rows; the ranks' encoder cache holds "
                    f"{self.encoder_cache_tokens} (--encoder-cache-tokens / the workers' encoder budget)",
                    field=field,
                )
            max_tensor = getattr(self.group, "max_tensor_bytes", 0)
            for name, elem in f.data.payload_fields().items():
                size = elem.data.numel() * elem.data.element_size()
                if max_tensor and size > max_tensor:
                    raise ResourceExhausted(
                        f"{where}: {name} has {size} bytes; the ranks accept tensors up to "
                        f"{max_tensor} bytes (the workers' max tensor size)",
                        field=field,
                    )
            nbytes = payload_nbytes(f)
            if nbytes > self.payload_cache_bytes:
                raise ResourceExhausted(
                    f"{where} has {nbytes} payload bytes; a rank's payload cache holds {self.payload_cache_bytes} "
                    "(--payload-cache-bytes / the workers' payload budget)",
                    field=field,
                )
            unique[f.identifier] = nbytes
        total = sum(unique.values())
        if self.config.transfer_mode == "full" and total > self.payload_cache_bytes:  # strip: transfer.py's doc
            raise ResourceExhausted(
                f"the request's images hold {total} payload bytes, more than a rank's payload cache "
                f"({self.payload_cache_bytes}); --transfer-mode={self.config.transfer_mode} sends them all at "
                "admission: use --transfer-mode lazy or give the workers a larger payload cache",
                field="messages",
            )

    def get_request(self, request_id: RequestId | str) -> Request | None:
        return self._requests.get(RequestId(request_id))

    def has_requests(self) -> bool:
        return bool(self._requests)

    # --- one step -----------------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        if self._outstanding is not None:
            raise FailedPrecondition(
                f"step {self._outstanding.step_id} is still in flight: call update_from_output() or recover() first"
            )
        kv, decider, bs = self.kv, self.decider, self.config.block_size
        self.live.expire()
        decider.begin_step()
        budget = self.config.max_num_batched_tokens
        finished_ids, self._pending_finished = self._pending_finished, []
        preempted: list[RequestId] = []
        scheduled: list[tuple[Request, int]] = []
        new_reqs: list[NewRequestData] = []
        deltas: list[RunningRequestData] = []
        alone = self.isolator.alone(r.request_id for r in (*self.running, *self.waiting))

        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            if alone is not None and r.request_id != alone:
                i += 1
                continue  # an isolated suspect runs alone this step; the others hold their blocks
            start = r.num_computed_tokens
            window = decider.plan_window(r, start, start + min(r.num_tokens - start, budget))
            n = window.end - start
            if n <= 0:
                i += 1
                continue  # its next item's encoder work does not fit this step; it waits, holding its blocks
            while not kv.can_allocate(r.request_id, start + n):
                if self.live.close_idle_one():
                    continue  # an idle live session's blocks come back before any running request is preempted
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is r:
                    break  # the newest left was the request itself: requeued, so nothing is left to free
            if r.status is not RequestStatus.RUNNING:
                break  # it was the newest and preempted itself: nothing older may be taken from
            appended = kv.allocate(r.request_id, start + n)
            decider.commit_window(r, window)
            deltas.append(RunningRequestData(r.request_id, r.all_token_ids[r.num_tokens_told :], appended, start, n))
            r.num_tokens_told = r.num_tokens
            scheduled.append((r, n))
            budget -= n
            i += 1
        finished_ids += preempted

        while not preempted and self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            r = self.waiting[0] if alone is None else self._requests[alone]
            if alone is not None and (r.status is not RequestStatus.WAITING or scheduled):
                break  # the isolated suspect is running, or was just scheduled: nothing joins it
            if r.request_id in finished_ids:
                break  # the ranks drop the finished request of the same id with this step; admit it next step
            if r.live is not None:  # the session's retained KV, never looked up in the prefix cache
                prefix, computed = r.live.blocks, r.live.computed
            else:
                prefix = kv.find_prefix(r)
                computed = len(prefix) * bs
            decider.place_cursor(r, computed)
            window = decider.plan_window(r, computed, computed + min(r.num_tokens - computed, budget))
            n = window.end - computed
            if n <= 0 or not decider.admission_fits(r):
                break  # FCFS: wait for room rather than let later requests overtake
            appended = kv.allocate(r.request_id, computed + n, prefix)
            if appended is None and self.live.close_idle_one():
                continue  # an idle live session gave its blocks back: try the head again
            if appended is None:
                break  # out of blocks: FCFS, the head waits and nothing overtakes it
            self.waiting.remove(r)  # the head, unless an isolated suspect is taken out of turn
            self.running.append(r)
            r.status = RequestStatus.RUNNING
            r.num_computed_tokens = computed
            kv.record_lookup(r.num_tokens, computed)
            if not r.admitted_once:
                r.admitted_once = True
                r.usage.cached_tokens = computed
            wire_items = decider.commit_admission(r, computed)
            decider.commit_window(r, window)
            new_reqs.append(
                NewRequestData(
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
            )
            if r.live is not None:
                r.live.admitted = True
            r.num_tokens_told = r.num_tokens
            scheduled.append((r, n))
            budget -= n

        if alone is not None and not scheduled:
            # The isolated suspect did not fit beside the requests the ranks hold (blocks, encoder room,
            # max_num_seqs): requeue them, so that it runs alone next step.
            for victim in [r for r in reversed(self.running) if r.request_id != alone]:
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim.request_id)
                finished_ids.append(victim.request_id)
        decider.finish_step()
        if not (scheduled or finished_ids or decider.mirrors.evict_payload_ids or self._reset_next):
            if self._requests:
                raise MmcastError(f"internal: {len(self._requests)} requests but nothing schedulable")
            return None
        accounting, released = decider.book.take_step(lambda rid: self._requests[rid].usage)
        sampling = [r for r, n in scheduled if r.num_computed_tokens + n == r.num_tokens]
        plan = StepPlan(
            step_id=self._next_step_id,
            new_requests=new_reqs,
            running=deltas,
            finished_request_ids=finished_ids,
            preempted_request_ids=preempted,
            encoder_inputs=decider.encoder_inputs,
            encoder_owners=decider.encoder_owners,
            evict_payload_ids=list(decider.mirrors.evict_payload_ids),
            evict_encoder_ids=decider.mirrors.evict_encoder_ids,
            reset_caches=self._reset_next,
            num_scheduled_tokens={r.request_id: n for r, n in scheduled},
            sampling_request_ids=[r.request_id for r in sampling],
            token_masks=step_masks(sampling),
            rank_payloads=decider.rank_payloads,
            accounting=accounting,
            items_examined=decider.items_examined,
            scheduled=scheduled,
            released=released,
            video_totals=decider.book.take_video(),
        )
        self._next_step_id += 1
        self._reset_next = False
        self._outstanding = plan
        return plan

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

    def schedule_ahead(self) -> StepPlan | None:
        """The step after the one in flight, planned before its tokens are known (``async_steps.py``), or None."""
        return plan_ahead(self)

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
        nothing) when the results do not match the plan.
        """
        sampled, failed, item_failures = outcome.sampled, outcome.failed, outcome.item_failures
        if plan is not self._outstanding:
            raise FailedPrecondition(f"step {plan.step_id} is not the step in flight (stale after a recovery?)")
        live = [(r, n) for r, n in plan.scheduled if self._requests.get(r.request_id) is r and not r.is_finished]
        expected = {r.request_id for r, n in live if r.num_computed_tokens + n == r.num_tokens}
        dropped = {r.request_id for r, _ in plan.scheduled} - {r.request_id for r, _ in live}  # finished meanwhile
        bad_items = self._failed_items(item_failures)
        spoiled = {rid for rid in self._requests if rid in bad_items}  # hold a failed item: none may sample
        missing = expected - set(sampled) - set(failed) - spoiled
        unexpected = (set(sampled) | set(failed)) - expected - dropped
        both = set(sampled) & set(failed)
        if missing or unexpected or both:
            raise StepOutputError(
                f"step {plan.step_id}: rank 0 returned no token for {sorted(missing)} and unexpected tokens for "
                f"{sorted(unexpected)}" + (f"; both a token and a failure for {sorted(both)}" if both else "")
            )
        self._outstanding, self._ahead = self._ahead, None
        self.decider.mirrors.end_step()
        updates = [self._fail_item(self._requests[rid], *bad_items[rid]) for rid in spoiled]
        for r, n in live:
            if r.request_id in spoiled:
                continue  # failed with its image above: its step's progress is void
            r.num_computed_tokens += n
            if r.live is None:
                self.kv.cache_full_blocks(r)
            self.decider.advance(r)
            if r.request_id not in expected:
                continue  # a prefill chunk: nothing sampled
            if r.request_id in failed:
                self._finish(r, FinishReason.ERROR)
                updates.append(
                    RequestUpdate(
                        r.request_id,
                        [],
                        None,
                        finished=FinishReason.ERROR,
                        usage=r.usage,
                        error=f"request {r.request_id} failed at the worker: {failed[r.request_id]}",
                        error_status=Status.INTERNAL,
                    )
                )
                continue  # rank 0 could not sample it: it ends here, without a token
            sample = sampled[r.request_id]
            token = sample.token_id
            r.append_output(token)
            update = RequestUpdate(
                r.request_id, [token], [(sample.logprob, sample.top_logprobs)] if r.sampling.return_logprobs else None
            )
            reason = self._stop_reason(r, token)
            if reason is FinishReason.STOP:
                update.stop_token_id = token
            elif r.grammar is not None:  # the grammar consumes the token; complete, it ends the request
                reason = grammar_verdict(r.grammar, token, update) or reason
            if reason is not None:
                self._finish(r, reason)
                update.finished, update.usage = reason, r.usage
            updates.append(update)
        if self.isolator.suspects:
            self.isolator.step_completed({r.request_id: r.num_computed_tokens for r, _ in live})
        return updates

    def _failed_items(self, item_failures: Mapping[ItemId, str]) -> dict[RequestId, tuple[int, str]]:
        """Requests holding a failed item: request id -> (index of its first failed image, message)."""
        out: dict[RequestId, tuple[int, str]] = {}
        if not item_failures:
            return out
        for rid, r in self._requests.items():
            for k, f in enumerate(r.mm_features):
                if f.identifier in item_failures:
                    out[rid] = (k, item_failures[f.identifier])
                    break  # the first failed image names the error
        return out

    def _fail_item(self, r: Request, index: int, message: str) -> RequestUpdate:
        """Ends a request whose image ``index`` failed at its owner rank (INVALID_ARGUMENT); the failed item's
        encoder-mirror entry goes with its last holder (the ranks never stored an output for it)."""
        key = r.mm_features[index].identifier
        if r.status is RequestStatus.RUNNING:
            self._finish(r, FinishReason.ERROR)
        else:
            self.finish_request(r.request_id, FinishReason.ERROR)
        self.decider.mirrors.forget_encoder(key)
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

    def _stop_reason(self, r: Request, token: int) -> FinishReason | None:
        if token in r.sampling.stop_token_ids or (not r.sampling.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if r.num_output_tokens >= r.sampling.max_tokens or r.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

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
        tokens generated so far; the step in flight is void.

        When the loss happened during a step, poison isolation judges its requests (``scheduler_svc/core/poison.py``);
        a request convicted of crashing the group is failed instead of requeued: its final update (ERROR,
        INTERNAL) is returned."""
        poisoned: list[RequestUpdate] = []
        if self._outstanding is not None:
            step = {
                r.request_id: r.num_computed_tokens + n
                for r, n in self._outstanding.scheduled
                if self._requests.get(r.request_id) is r
            }
            convicted = self.isolator.step_failed(step)
            if convicted is not None:
                r = self._requests[convicted]
                self._finish(r, FinishReason.ERROR)  # a scheduled request is running until the step's output
                poisoned.append(
                    RequestUpdate(
                        r.request_id,
                        [],
                        None,
                        finished=FinishReason.ERROR,
                        usage=r.usage,
                        error_status=Status.INTERNAL,
                        error=f"request {r.request_id} crashed the worker group twice, the second time running alone; "
                        "it is failed so that the group keeps serving the other requests"
                        + (f"; the group was lost: {reason}" if reason else ""),
                    )
                )
        self._outstanding = self._ahead = None
        for r in [r for r in (*self.running, *self.waiting) if r.live is not None]:
            if r in self.waiting:
                self.waiting.remove(r)
            # the ranks' KV is gone with the group: a live turn cannot go on, nor its session
            poisoned.append(self._fail_live(r, "the worker group restarted", Status.UNAVAILABLE, told=False))
        self._deferred = [u for u in self._deferred if all(u is not p for p in poisoned)]
        self.live.drop_all()
        for r in self.running:
            self.kv.free(r.request_id)
            r.reset_progress()
            r.status = RequestStatus.WAITING
            r.usage.preemptions += 1  # requeued by the recovery; resumed as new like a preempted request
        self.waiting.extendleft(reversed(self.running))
        self.running = []
        self.kv.reset_prefix_cache()
        self.decider.reset()
        self._pending_finished = []  # fresh ranks hold no request
        self._reset_next = True
        return poisoned

    def reset_group(self, group: GroupBudget) -> list[RequestUpdate]:
        """New budgets after a reconnect (call ``recover`` first). Waiting requests that no longer fit fail with
        ERROR; their final updates are returned."""
        if self.running or self._outstanding is not None:
            raise FailedPrecondition("reset_group() needs no running request and no step in flight; recover() first")
        self._apply_group(group)
        self._reset_next = True
        failed = []
        for r in list(self.waiting):
            try:
                self._check_fits_group(r)
            except MmcastError as exc:
                update = self.finish_request(r.request_id, FinishReason.ERROR, error=exc.message)
                failed.append(update)
        return failed

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
