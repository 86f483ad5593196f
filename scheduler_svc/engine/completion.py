"""The one request path behind both client APIs: admit a prompt, stream its text, report how it ended.

The gRPC servicer (servicer.py) and the OpenAI HTTP API (openai_api.py) each translate their own request format
into a ``CompletionRequest`` and their own responses out of ``Chunk`` and ``CompletionResult``; everything between
— the limits, the frontend, tenant scoping, the engine, stop strings, cancellation, the finished-request log line —
is this module's, so nothing about transfers, caches or accounting differs by door. Errors are ``common.errors``
exceptions; each door maps them to its protocol once (common/rich_status.py, openai_errors.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from common import penalties, tracing
from common.errors import InvalidArgument, MmcastError, Unavailable
from common.ids import RequestId
from scheduler_svc.core import admission
from scheduler_svc.core.structured_output import GrammarSpec
from scheduler_svc.engine import affinity_key, prompt_lists, request_input
from scheduler_svc.engine.detok import Detokenizer
from scheduler_svc.engine.request_handle import FinishEvent, RequestHandle, TokenEvent
from scheduler_svc.engine.request_input import SamplingSpec
from scheduler_svc.engine.request_log import RequestSummary
from scheduler_svc.engine.step_loop import Engine
from scheduler_svc.engine.tenancy import scoped_cache_salt, scoped_request_id

log = logging.getLogger("scheduler_svc.servicer")  # the name the request log lines have always carried

# Field paths the shared checks name; each door renames them to its own request's paths where they differ.
MAX_TOKENS_FIELD = admission.GENERATE_FIELD


@dataclasses.dataclass(frozen=True)
class CompletionRequest:
    """One request as either door parsed it; every field already passed that door's own format checks."""

    client_id: str  # the request id as the client gave it (checked), or one the door made up
    tenant: str  # the caller's tenant ("" when authentication is off)
    sampling: SamplingSpec  # max_tokens is a placeholder when ``default_max_tokens`` is set
    received: float  # time.monotonic() when the call arrived: TTFT and queue time count from here
    turns: Sequence[request_input.Turn] | None = None  # a chat conversation; exactly one of turns / prompt
    prompt: str | None = None  # a plain text prompt, tokenized as is (no chat template)
    prompt_token_ids: tuple[int, ...] | None = None  # a prompt given as token ids (checked by the door), or None
    cache_salt: str = ""  # the client's prefix-cache salt (checked)
    add_generation_prompt: bool = True  # chat: append the template's assistant header for a new answer
    continue_final_message: bool = False  # chat: the answer continues the last message's text (its turn left open)
    default_max_tokens: bool = False  # True: max_tokens not given; take what the context leaves, up to the limit
    affinity: str = ""  # the conversation key the client chose (affinity_key.client_key), "" for none
    live: request_input.LiveSpec | None = None  # the next turn of a live session (live_sessions.py)
    grammar: GrammarSpec | None = None  # structured output: the grammar the answer must follow (None: free text)
    tools: tuple[dict, ...] = ()  # OpenAI tools, passed to the chat template (tool_calls.py)
    # True (the HTTP door, whose x-request-id is a client's label, as vLLM treats it): an id still in flight gets a
    # random suffix, "<id>.<12 hex>", instead of ALREADY_EXISTS. False (gRPC): the id is the engine's, unique.
    id_reusable: bool = False


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Tokens produced since the previous chunk, with their text (which may lag at multi-byte boundaries)."""

    token_ids: list[int]
    text: str
    logprobs: list  # one (logprob, [(token_id, logprob), ...]) per token when asked, else empty


@dataclasses.dataclass(frozen=True)
class CompletionResult:
    """How a completion ended; set once its chunks are exhausted."""

    finish_reason: str  # "stop" | "length" | "cancelled" | "error"
    stop_reason: str  # the stop string that ended the text, or ""
    error: MmcastError | None  # set iff finish_reason == "error": the failure after the first token
    summary: RequestSummary  # what the finished-request log line holds (tokens, cached tokens, bytes, times)
    usage: object  # the engine's RequestUsage: per-request item and byte accounting


def summarize(
    handle: RequestHandle, finish: FinishEvent, processed, completion_tokens: int, ttft: float | None, tenant: str
) -> RequestSummary:
    """What the final message and the finished-request log line report, taken once."""
    u = handle.usage
    now = time.monotonic()
    error = finish.error
    return RequestSummary(
        request_id=handle.request_id,
        tenant=tenant,
        finish_reason=finish.reason,
        prompt_tokens=len(processed.token_ids),
        completion_tokens=completion_tokens,
        cached_tokens=u.cached_tokens,
        images=processed.num_images,
        videos=processed.num_videos,
        payload_bytes_broadcast=u.payload_bytes_sent,
        payload_bytes_saved=u.payload_bytes_saved,
        preemptions=u.preemptions,
        time_to_first_token_seconds=ttft,
        total_seconds=now - handle.received_at,
        queue_seconds=(handle.first_scheduled_at or now) - handle.received_at,
        stage_seconds=handle.stages.seconds(),
        error_code=error.status.value if error is not None else "",
        error=error.message if error is not None else "",
    )


class Completion:
    """An admitted request. Iterate ``chunks()`` once; leaving it early (the client went away) cancels the request
    and frees what it holds. ``result`` is set when the iteration ends normally."""

    def __init__(
        self,
        engine: Engine,
        tokenizer,
        handle: RequestHandle,
        processed,
        sampling: SamplingSpec,
        tenant: str,
        affinity: str = "",
        frontend=None,
    ) -> None:
        self.engine = engine
        self.frontend = frontend  # forgets what a failed request added to the processor cache
        self.affinity = affinity  # the conversation key each door returns as x-mmcast-affinity (affinity_key.py)
        self.tokenizer = tokenizer
        self.handle = handle
        self.processed = processed  # frontend.ProcessedPrompt: token ids, items, image cpu time
        self.sampling = sampling  # the effective parameters (max_tokens resolved)
        self.tenant = tenant
        self.result: CompletionResult | None = None
        self.first_token_at: float | None = None  # time.monotonic() of the first chunk with tokens
        self.stage_histogram = engine.metrics.request_stage_seconds
        self.live = None  # a live turn: its live_sessions.LiveTurn (``state`` says what the session holds after it)

    def first_byte_written(self) -> None:
        """The door hands the first token's message to its server to write (a streamed answer; call once, just
        before): ends the ``first_byte`` stage, which starts when the engine delivered the token and leaves out its
        detokenization. Not when the write completes: grpc resumes the handler only when the event loop next
        polls its completions, often after the client already holds the message."""
        stages, delivered = self.handle.stages, self.handle.first_token_at
        if stages.first_byte is None and delivered is not None:
            stages.first_byte = time.monotonic() - delivered - (stages.detokenize or 0.0)

    @property
    def prompt_tokens(self) -> int:
        return len(self.processed.token_ids)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Chunks until the request ends. A failure before the first token raises its ``MmcastError`` (a plain
        refusal a client may retry); after it, the failure ends the iteration with ``result.error`` set, so the
        tokens already sent stand."""
        handle, sampling = self.handle, self.sampling
        text = Detokenizer(self.tokenizer, sampling.stop)
        completion_tokens = 0
        finish: FinishEvent | None = None
        ttft = None
        summary: RequestSummary | None = None
        try:
            while finish is None:
                event = await handle.events.get()
                if isinstance(event, FinishEvent):
                    finish = event
                    if event.error is not None and completion_tokens == 0:
                        raise event.error
                    break
                assert isinstance(event, TokenEvent)
                ids = event.token_ids[: sampling.max_tokens - completion_tokens]
                completion_tokens += len(ids)
                if ttft is None:
                    self.first_token_at = time.monotonic()
                    ttft = self.first_token_at - handle.received_at
                    d0 = time.perf_counter()
                    delta = text.add(ids)
                    handle.stages.detokenize = time.perf_counter() - d0
                else:
                    delta = text.add(ids)
                chunk = Chunk(ids, delta, list(event.logprobs[: len(ids)]) if sampling.return_logprobs else [])
                if text.stopped_by is not None:
                    self.engine.finish(handle.request_id, "stop")
                    finish = FinishEvent("stop")
                yield chunk
            tail = text.flush()
            if tail:
                yield Chunk([], tail, [])
            summary = summarize(handle, finish, self.processed, completion_tokens, ttft, self.tenant)
            self.result = CompletionResult(finish.reason, text.stopped_by or "", finish.error, summary, handle.usage)
        finally:
            if not handle.finished:
                self.engine.finish(handle.request_id, "cancelled")
                log.info("request cancelled by the client", extra={"request_id": handle.request_id})
                finish = FinishEvent("cancelled")
            if summary is None:  # no result: the client left, or the request failed before its first token
                summary = summarize(
                    handle, finish or FinishEvent("cancelled"), self.processed, completion_tokens, ttft, self.tenant
                )
            summary.log(log)
            if finish is not None and finish.error is not None and self.frontend is not None:
                self.frontend.forget(self.processed)  # a failed request keeps nothing in the processor cache
            if ttft is not None:  # the histogram holds TTFT breakdowns: requests that got a first token
                for stage, seconds in summary.stage_seconds.items():
                    self.stage_histogram.labels(stage).observe(seconds)

    def cancel(self) -> None:
        """Ends the request from the client side (a stream that was never iterated, a deadline)."""
        if not self.handle.finished:
            self.engine.finish(self.handle.request_id, "cancelled")


class Completions:
    """Admission, shared by both doors: request-id scoping, the frontend off the event loop, the context check,
    the engine's queue. ``draining`` refuses new requests during a graceful shutdown."""

    def __init__(self, *, engine: Engine, frontend, config, tokenizer, make_request, grammars=None) -> None:
        self.engine = engine
        self.frontend = frontend
        self.config = config
        self.tokenizer = tokenizer
        self.make_request = make_request  # (request_id, processed prompt, SamplingSpec, cache_salt) -> core Request
        self.grammars = grammars  # structured_output.GrammarCompiler (None: structured output refused)
        # Every header check, decode and tokenization runs here, never on the event loop; the frontend bounds how
        # many decodes run at once (--max-concurrent-decodes) and gives each thread its own tokenizer.
        self.executor = ThreadPoolExecutor(max_workers=config.frontend_threads, thread_name_prefix="frontend")
        self.draining = False

    async def run_in_executor(self, fn, *args):
        """``fn(*args)`` on the frontend's threads (image headers, base64, anything CPU-bound of a request)."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, functools.partial(fn, *args))

    async def admit(self, req: CompletionRequest) -> Completion:
        """Processes and queues ``req``. Raises ``MmcastError`` (nothing is left behind: a refused request's images
        do not enter the processor cache and it holds no engine state)."""
        if self.draining:
            raise Unavailable("the server is draining for shutdown; retry on another replica")
        request_id = scoped_request_id(req.tenant, req.client_id)
        if req.live is not None:
            if req.grammar is not None:
                raise InvalidArgument("structured output is not served on live-session turns", field=req.grammar.field)
            return await self._admit_live(req, request_id)
        sampling = req.sampling
        reserve = 1 if req.default_max_tokens else sampling.max_tokens
        context = self.engine.max_model_len
        parsed_at = time.monotonic()  # the door's own reading and translation of the call end here
        with tracing.span("mmcast.frontend", request_id=request_id) as current:  # decode, preprocess, tokenize
            if req.prompt_token_ids is not None:
                process = functools.partial(
                    prompt_lists.process_token_ids,
                    self.frontend,
                    req.prompt_token_ids,
                    reserve_tokens=reserve,
                    context=context,
                )
            elif req.prompt is not None:
                process = functools.partial(
                    self.frontend.process_text, req.prompt, reserve_tokens=reserve, context=context
                )
            else:
                process = functools.partial(
                    self.frontend.process,
                    req.turns,
                    add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message,
                    tenant=req.tenant,
                    reserve_tokens=reserve,
                    context=context,
                    tools=req.tools,
                )

            # The conversation key hashes the first message's inline images: off the loop, beside the frontend.
            def work():
                grammar = self._grammar(req.grammar)  # compiled (or refused) before the prompt costs anything
                words = sampling.penalties.with_bad_word_ids(self.frontend.encode_words) if bad_words else None
                text = req.prompt if req.prompt_token_ids is None else " ".join(map(str, req.prompt_token_ids))
                return process(), req.affinity or affinity_key.key_of(req.turns, text), words, grammar

            bad_words = bool(sampling.penalties.bad_words)
            f0 = time.perf_counter()
            processed, key, words, grammar = await asyncio.get_running_loop().run_in_executor(self.executor, work)
            if words is not None:
                sampling = dataclasses.replace(sampling, penalties=words)
            frontend_seconds = time.perf_counter() - f0
            tracing.set_attributes(current, prompt_tokens=len(processed.token_ids), images=len(processed.mm_features))
        prompt_tokens = len(processed.token_ids)
        if req.default_max_tokens:
            room = context - prompt_tokens if context else 2**31 - 1
            cap = min(self.config.max_tokens_limit or room, room)  # --max-tokens-limit 0: the context alone
            sampling = dataclasses.replace(sampling, max_tokens=max(1, cap))
            penalties.check_min_tokens(sampling.penalties.min_tokens, sampling.max_tokens)
        prompt_field = "messages" if req.turns is not None else "prompt"
        admission.check_request_fits(prompt_field, prompt_tokens, sampling.max_tokens, context)
        salt = scoped_cache_salt(req.tenant, req.cache_salt)
        if req.id_reusable and request_id in self.engine.handles:  # checked and submitted without an await between
            request_id = RequestId(f"{request_id}.{uuid.uuid4().hex[:12]}")
        request = self.make_request(request_id, processed, sampling, salt)
        request.grammar = grammar
        handle = self.engine.submit(request, req.received)
        handle.stages.http_parse, handle.stages.frontend = parsed_at - req.received, frontend_seconds
        try:
            self.frontend.commit(processed)  # admitted: only now may its new images enter the processor cache
        except Exception:
            self.engine.finish(handle.request_id, "cancelled")  # admitted before the failure: free what it holds
            raise
        log.info("request admitted", extra={"request_id": request_id, "prompt_tokens": prompt_tokens})
        return Completion(self.engine, self.tokenizer, handle, processed, sampling, req.tenant, key, self.frontend)

    def _grammar(self, spec: GrammarSpec | None):
        if spec is None:
            return None
        if self.grammars is None:
            raise InvalidArgument("structured output is not served by this server", field=spec.field)
        return self.grammars.compile(spec)

    async def _admit_live(self, req: CompletionRequest, request_id) -> Completion:
        """A live session's turn: the session is reserved for it, its new messages processed, and the request built
        on the session's retained KV. Refused on the way, it leaves the session as it was."""
        core = self.engine.core
        if core is None:
            raise Unavailable("the worker group is not connected yet; retry later", retry_after=1.0)
        if req.default_max_tokens:
            raise InvalidArgument("a live turn needs max_tokens", field=MAX_TOKENS_FIELD)
        sampling = req.sampling
        if sampling.penalties.bad_words:
            words = await self.run_in_executor(sampling.penalties.with_bad_word_ids, self.frontend.encode_words)
            sampling = dataclasses.replace(sampling, penalties=words)
        sessions = core.live
        session = sessions.reserve((req.tenant, req.live.session_id), request_id, req.live.keep_turns)
        try:
            f0 = time.perf_counter()
            parsed_at = time.monotonic()
            processed, turn_start, extent, close_ids = await self.run_in_executor(
                functools.partial(
                    self.frontend.process_live,
                    req.turns,
                    first=not session.opened,
                    tenant=req.tenant,
                    reserve_tokens=req.sampling.max_tokens,
                    context=self.engine.max_model_len,
                )
            )
            frontend_seconds = time.perf_counter() - f0
            if self.engine.core is not core:
                raise Unavailable("the worker group restarted while the turn was prepared; retry", retry_after=1.0)
            prompt, at, turn = sessions.build(
                session,
                request_id,
                turn_ids=processed.token_ids,
                turn_start=turn_start,
                extent=extent,
                close_ids=close_ids,
                max_tokens=req.sampling.max_tokens,
                close=req.live.close,
            )
            admission.check_request_fits("messages", len(prompt), req.sampling.max_tokens, self.engine.max_model_len)
            whole = dataclasses.replace(
                processed,
                token_ids=prompt,
                mm_features=[f.shifted(at) for f in processed.mm_features],
            )
            request = self.make_request(request_id, whole, sampling, None)
            request.live = turn
            handle = self.engine.submit(request, req.received)
        except BaseException:
            sessions.release(session, request_id)
            raise
        handle.stages.http_parse, handle.stages.frontend = parsed_at - req.received, frontend_seconds
        self.frontend.commit(whole)
        log.info(
            "live turn admitted",
            extra={"request_id": request_id, "prompt_tokens": len(prompt), "cached_tokens": turn.computed},
        )
        completion = Completion(
            self.engine, self.tokenizer, handle, whole, sampling, req.tenant, req.affinity, self.frontend
        )
        completion.live = turn
        return completion
