"""``POST /v1/completions``: OpenAI's legacy text completions, translated onto the shared request path.

A request lists one prompt or several (strings or token-id arrays: prompt_lists.py); each prompt is admitted as a
request of its own, all or none (a refused prompt cancels the ones admitted before it, and its error names it:
``prompt[2]: ...``). The answer holds one choice per prompt, indexed as OpenAI indexes them, and the usage of all of
them summed; a stream interleaves the prompts' chunks, each tagged with its choice's index.

``n`` > 1 gives each prompt ``n`` choices from one prefill, as on the chat endpoint (openai_choices.py): the prompt's
first choice is admitted alone, the others once its first token is out (its prompt blocks are then in the prefix
cache), with ids ``<id>.<j>`` and, for a seeded request, seeds ``seed + j``. Usage counts each prompt once.

``echo`` puts the prompt's text before the generated text (a token-id prompt decoded). With ``logprobs`` it would
need the prompt tokens' log-probabilities, which the ranks do not compute: refused, naming ``echo``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import MmcastError
from scheduler_svc.doors import grammar_requests, request_parsing
from scheduler_svc.doors.openai_choices import follower_request
from scheduler_svc.doors.openai_errors import HttpError
from scheduler_svc.doors.openai_sse import SSE_HEADERS, ClientGone, sse_event
from scheduler_svc.engine import prompt_lists
from scheduler_svc.engine.completion import Completion, CompletionRequest

_FINISH = {"stop": "stop", "length": "length"}


@dataclasses.dataclass
class Choice:
    """One choice of the answer: its request, the iterator of its chunks, its prompt and its OpenAI index."""

    completion: Completion
    chunks: AsyncIterator  # Completion.chunks(); a leader's first chunk, read before its followers were admitted, first
    prompt: int  # index of its prompt in the request's list
    index: int  # prompt * n + j


async def _primed(first, rest: AsyncIterator) -> AsyncIterator:
    """``first`` (unless None: the stream had ended), then what ``rest`` yields; closing this closes ``rest``."""
    try:
        if first is not None:
            yield first
            async for chunk in rest:
                yield chunk
    finally:
        await rest.aclose()


class TextCompletions:
    """The endpoint, on the routes and helpers of ``api`` (an openai_api.OpenAIApi)."""

    def __init__(self, api) -> None:
        self.api = api

    # --- translation in ---------------------------------------------------------------------------------------
    async def admit(self, request: Request, call, body, received: float) -> list[Choice]:
        """Every choice of every prompt of ``body`` admitted, in order; raises (with none left running) when one is
        refused."""
        api = self.api
        prompts = prompt_lists.prompt_list(body.prompt, api.config.max_prompts_per_request)
        if body.echo and body.logprobs is not None:
            raise HttpError(
                400,
                "echo with logprobs needs the prompt tokens' log-probabilities, which this server does not compute; "
                "send echo or logprobs, not both",
                param="echo",
                code="unsupported",
            )
        request_parsing.check_cache_salt(body.cache_salt or "")
        sampling, default_max = api._sampling(call, body)
        grammar = grammar_requests.from_openai(body)
        placeholders = prompt_lists.placeholder_ids(api.frontend)
        requests = []
        for i, prompt in enumerate(prompts):
            field = prompt_lists.prompt_field(i, len(prompts))
            if isinstance(prompt, tuple):
                prompt_lists.check_token_ids(prompt, field, api.frontend.vocab_size, placeholders)
            requests.append(
                CompletionRequest(
                    client_id=call.client_id if len(prompts) == 1 else f"{call.client_id}-{i}",
                    id_reusable=True,
                    tenant=call.tenant,
                    sampling=sampling,
                    received=received,
                    prompt=prompt if isinstance(prompt, str) else None,
                    prompt_token_ids=prompt if isinstance(prompt, tuple) else None,
                    cache_salt=body.cache_salt or "",
                    default_max_tokens=default_max,
                    affinity=call.affinity,
                    grammar=grammar,
                )
            )
        call.prompts = prompts
        choices: list[Choice] = []
        try:
            for i, req in enumerate(requests):
                try:
                    choices += await self._admit_prompt(request, req, i, body.n)
                except MmcastError as err:
                    if len(requests) == 1:
                        raise
                    raise self._in_prompt(err, call, i) from None
        except BaseException:
            for choice in choices:
                await choice.chunks.aclose()  # an unfinished request is cancelled (Completion.chunks)
                choice.completion.cancel()
            raise
        return choices

    async def _admit_prompt(self, request: Request, req: CompletionRequest, prompt: int, n: int) -> list[Choice]:
        """The ``n`` choices of one prompt: the first alone, the others once its prompt blocks are cached."""
        api, choices = self.api, []
        try:
            for j in range(n):
                r = req if j == 0 else follower_request(req, j)
                completion = await api._until_disconnect(request, api.completions.admit(r))
                chunks = completion.chunks()
                choices.append(Choice(completion, chunks, prompt, prompt_lists.choice_index(prompt, j, n)))
                if j == 0 and n > 1:  # its prompt blocks are registered once a token is out
                    first = await api._until_disconnect(request, anext(chunks, None))
                    choices[0].chunks = _primed(first, chunks)
        except BaseException:
            for choice in choices:
                await choice.chunks.aclose()
                choice.completion.cancel()
            raise
        return choices

    def _in_prompt(self, err: MmcastError, call, i: int) -> HttpError:
        """``err`` of the ``i``-th of several prompts, its message and field naming that prompt."""
        e = self.api._http_error(err, call)
        if e.param == "prompt" or e.param is None:
            e.param = f"prompt[{i}]"
        elif e.param.startswith("prompt["):  # a token's position within the prompt
            e.param = f"prompt[{i}]" + e.param.removeprefix("prompt")
        e.message = f"prompt[{i}]: {e.message}"
        return e

    def _prompt_text(self, prompt: prompt_lists.Prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.api.completions.tokenizer.decode(list(prompt), skip_special_tokens=False)

    # --- translation out --------------------------------------------------------------------------------------
    async def respond(self, request: Request, call, body, choices: list[Choice]) -> Response:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream(request, call, body, choices, include_usage)
        return await self._whole(request, call, body, choices)

    def _logprobs(self, chunks, offset: int = 0) -> dict:
        tokens, values, tops, offsets = [], [], [], []
        text_of = self.api._text_of
        for chunk in chunks:
            for tok, (lp, top) in zip(chunk.token_ids, chunk.logprobs, strict=False):
                s = text_of(tok)
                tokens.append(s)
                values.append(lp)
                tops.append({text_of(t): v for t, v in top})
                offsets.append(offset)
                offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _usage(choices: list[Choice]) -> dict:
        """Each prompt once (its largest prefix hit as its cached tokens), every choice's generated tokens."""
        by_prompt: dict[int, list] = {}
        for c in choices:
            by_prompt.setdefault(c.prompt, []).append(c.completion.result.summary)
        prompt = sum(group[0].prompt_tokens for group in by_prompt.values())
        cached = sum(max(s.cached_tokens for s in group) for group in by_prompt.values())
        generated = sum(c.completion.result.summary.completion_tokens for c in choices)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _envelope(self, call) -> dict:
        return {"id": call.object_id, "object": "text_completion", "created": call.created, "model": call.model}

    async def _whole(self, request: Request, call, body, chosen: list[Choice]) -> Response:
        api = self.api

        async def collect(choice: Choice) -> list:
            return [chunk async for chunk in choice.chunks]

        try:
            results = await api._until_disconnect(request, _all_or_none([collect(c) for c in chosen]))
        except ClientGone:
            return Response(status_code=499)
        except MmcastError as err:  # failed before its first token
            return api._error(api._http_error(err, call))
        except Exception:
            return api._internal(call)
        choices = []
        for choice, chunks in zip(chosen, results, strict=True):
            completion = choice.completion
            err = api._ended_badly(completion)
            if err is not None:
                return api._error(api._http_error(err, call))
            result = completion.result
            text = "".join(c.text for c in chunks)
            choices.append(
                {
                    "index": choice.index,
                    "text": (self._prompt_text(call.prompts[choice.prompt]) if body.echo else "") + text,
                    "logprobs": self._logprobs(chunks) if completion.sampling.return_logprobs else None,
                    "finish_reason": _FINISH[result.finish_reason],
                    "stop_reason": result.stop_reason or None,
                }
            )
        out = {**self._envelope(call), "choices": choices, "usage": self._usage(chosen)}
        return JSONResponse(out, headers=api._headers(call, chosen[0].completion))

    async def _stream(self, request, call, body, choices: list[Choice], include_usage: bool) -> Response:
        api, streams = self.api, [c.chunks for c in choices]
        try:  # every prompt's first chunk before the response starts: a failure now gets a plain HTTP error
            firsts = await api._until_disconnect(request, _all_or_none([anext(s, None) for s in streams]))
        except BaseException as exc:
            for s in streams:
                await s.aclose()
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            if isinstance(exc, MmcastError):
                return api._error(api._http_error(exc, call))
            if isinstance(exc, Exception):
                return api._internal(call)
            raise
        return StreamingResponse(
            self._events(call, body, choices, firsts, include_usage),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **self.api._headers(call, choices[0].completion)},
        )

    async def _events(self, call, body, choices: list[Choice], firsts, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events of every prompt's choice, interleaved as their chunks come, then ``data: [DONE]``.
        When the client disconnects Starlette cancels this generator, and every prompt's request with it."""
        streams = [c.chunks for c in choices]
        envelope = self._envelope(call)
        usage_field = {"usage": None} if include_usage else {}
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            chunk = firsts[i]
            try:
                while chunk is not None:
                    await queue.put((i, chunk))
                    chunk = await anext(streams[i], None)
            except Exception as exc:  # a server bug: raised where the events are written
                await queue.put((i, exc))
            await queue.put((i, None))

        def event(choice: dict) -> bytes:
            return sse_event({**envelope, "choices": [choice], **usage_field})

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        offsets, first_written, open_streams = [0] * len(streams), False, len(streams)
        try:
            for choice in choices if body.echo else ():
                text = self._prompt_text(call.prompts[choice.prompt])
                yield event({"index": choice.index, "text": text, "logprobs": None, "finish_reason": None})
            while open_streams:
                i, chunk = await queue.get()
                if isinstance(chunk, Exception):
                    raise chunk
                completion = choices[i].completion
                if chunk is None:
                    open_streams -= 1
                    yield self._last_event(call, completion, choices[i].index, event)
                    continue
                logprobs = completion.sampling.return_logprobs
                if not (chunk.text or (logprobs and chunk.token_ids)):
                    continue  # nothing to say yet (text held back at a character or stop-string boundary)
                choice = {
                    "index": choices[i].index,
                    "text": chunk.text,
                    "logprobs": self._logprobs([chunk], offsets[i]) if logprobs else None,
                    "finish_reason": None,
                }
                if not first_written:  # handed to the server's transport next, as the gRPC door does
                    completion.first_byte_written()
                    first_written = True
                yield event(choice)
                offsets[i] += len(chunk.text)
            done = [c.completion.result for c in choices]
            if include_usage and all(r is not None and r.error is None for r in done):
                yield sse_event({**envelope, "choices": [], "usage": self._usage(choices)})
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # a server bug mid-stream: the stream still ends in OpenAI's shape, naming the id
            api = self.api
            e = api._http_error(exc, call) if isinstance(exc, MmcastError) else api._internal_error(call)
            yield sse_event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
            yield b"data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # idle streams only may be closed
            for s in streams:
                await s.aclose()

    def _last_event(self, call, completion: Completion, index: int, event) -> bytes:
        api = self.api
        err = api._ended_badly(completion)
        if err is not None:
            e = api._http_error(err, call)
            return sse_event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        result = completion.result
        return event(
            {
                "index": index,
                "text": "",
                "logprobs": None,
                "finish_reason": _FINISH[result.finish_reason],
                "stop_reason": result.stop_reason or None,
            }
        )


async def _all_or_none(awaitables: list) -> list:
    """The results of ``awaitables`` run at once; when one fails or this is cancelled, the others are cancelled and
    awaited before it returns (so every stream they were reading is idle again, and may be closed)."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
