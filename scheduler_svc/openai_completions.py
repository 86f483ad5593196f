"""``POST /v1/completions``: OpenAI's legacy text completions, translated onto the shared request path.

A request lists one prompt or several (strings or token-id arrays: prompt_lists.py); each prompt is admitted as a
request of its own, all or none (a refused prompt cancels the ones admitted before it, and its error names it:
``prompt[2]: ...``). The answer holds one choice per prompt, indexed as OpenAI indexes them, and the usage of all of
them summed; a stream interleaves the prompts' chunks, each tagged with its choice's index.

``echo`` puts the prompt's text before the generated text (a token-id prompt decoded). With ``logprobs`` it would
need the prompt tokens' log-probabilities, which the ranks do not compute: refused, naming ``echo``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import MmcastError
from scheduler_svc import prompt_lists, request_parsing
from scheduler_svc.completion import Completion, CompletionRequest
from scheduler_svc.openai_api import SSE_HEADERS, _ClientGone, _sse
from scheduler_svc.openai_errors import HttpError

_FINISH = {"stop": "stop", "length": "length"}
N = 1  # choices per prompt (the n of OpenAI's indexing)


class TextCompletions:
    """The endpoint, on the routes and helpers of ``api`` (an openai_api.OpenAIApi)."""

    def __init__(self, api) -> None:
        self.api = api

    # --- translation in ---------------------------------------------------------------------------------------
    async def admit(self, request: Request, call, body, received: float) -> list[Completion]:
        """Every prompt of ``body`` admitted, in order; raises (with none left running) when one is refused."""
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
                )
            )
        call.prompts = prompts
        admitted: list[Completion] = []
        try:
            for i, req in enumerate(requests):
                try:
                    admitted.append(await api._until_disconnect(request, api.completions.admit(req)))
                except MmcastError as err:
                    if len(requests) == 1:
                        raise
                    raise self._in_prompt(err, call, i) from None
        except BaseException:
            for completion in admitted:
                completion.cancel()
            raise
        return admitted

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
    async def respond(self, request: Request, call, body, completions: list[Completion]) -> Response:
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return await self._stream(request, call, body, completions, include_usage)
        return await self._whole(request, call, body, completions)

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
    def _usage(completions: list[Completion]) -> dict:
        prompt = sum(c.result.summary.prompt_tokens for c in completions)
        generated = sum(c.result.summary.completion_tokens for c in completions)
        cached = sum(c.result.summary.cached_tokens for c in completions)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": generated,
            "total_tokens": prompt + generated,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def _envelope(self, call) -> dict:
        return {"id": call.object_id, "object": "text_completion", "created": call.created, "model": call.model}

    async def _whole(self, request: Request, call, body, completions: list[Completion]) -> Response:
        api = self.api

        async def collect(completion: Completion) -> list:
            return [chunk async for chunk in completion.chunks()]

        try:
            results = await api._until_disconnect(request, _all_or_none([collect(c) for c in completions]))
        except _ClientGone:
            return Response(status_code=499)
        except MmcastError as err:  # failed before its first token
            return api._error(api._http_error(err, call))
        except Exception:
            return api._internal(call)
        choices = []
        for i, (completion, chunks) in enumerate(zip(completions, results, strict=True)):
            err = api._ended_badly(completion)
            if err is not None:
                return api._error(api._http_error(err, call))
            result = completion.result
            text = "".join(c.text for c in chunks)
            choices.append(
                {
                    "index": prompt_lists.choice_index(i, 0, N),
                    "text": (self._prompt_text(call.prompts[i]) if body.echo else "") + text,
                    "logprobs": self._logprobs(chunks) if completion.sampling.return_logprobs else None,
                    "finish_reason": _FINISH[result.finish_reason],
                    "stop_reason": result.stop_reason or None,
                }
            )
        out = {**self._envelope(call), "choices": choices, "usage": self._usage(completions)}
        return JSONResponse(out, headers=api._headers(call, completions[0]))

    async def _stream(self, request, call, body, completions: list[Completion], include_usage: bool) -> Response:
        api, streams = self.api, [c.chunks() for c in completions]
        try:  # every prompt's first chunk before the response starts: a failure now gets a plain HTTP error
            firsts = await api._until_disconnect(request, _all_or_none([anext(s, None) for s in streams]))
        except BaseException as exc:
            for s in streams:
                await s.aclose()
            if isinstance(exc, _ClientGone):
                return Response(status_code=499)
            if isinstance(exc, MmcastError):
                return api._error(api._http_error(exc, call))
            if isinstance(exc, Exception):
                return api._internal(call)
            raise
        return StreamingResponse(
            self._events(call, body, completions, streams, firsts, include_usage),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **self.api._headers(call, completions[0])},
        )

    async def _events(self, call, body, completions, streams, firsts, include_usage: bool) -> AsyncIterator[bytes]:
        """Server-sent events of every prompt's choice, interleaved as their chunks come, then ``data: [DONE]``.
        When the client disconnects Starlette cancels this generator, and every prompt's request with it."""
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
            return _sse({**envelope, "choices": [choice], **usage_field})

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        offsets, first_written, open_streams = [0] * len(streams), False, len(streams)
        try:
            for i in range(len(streams) if body.echo else 0):
                text = self._prompt_text(call.prompts[i])
                yield event({"index": i, "text": text, "logprobs": None, "finish_reason": None})
            while open_streams:
                i, chunk = await queue.get()
                if isinstance(chunk, Exception):
                    raise chunk
                completion = completions[i]
                if chunk is None:
                    open_streams -= 1
                    yield self._last_event(call, completion, i, event)
                    continue
                logprobs = completion.sampling.return_logprobs
                if not (chunk.text or (logprobs and chunk.token_ids)):
                    continue  # nothing to say yet (text held back at a character or stop-string boundary)
                choice = {
                    "index": prompt_lists.choice_index(i, 0, N),
                    "text": chunk.text,
                    "logprobs": self._logprobs([chunk], offsets[i]) if logprobs else None,
                    "finish_reason": None,
                }
                if not first_written:  # handed to the server's transport next, as the gRPC door does
                    completion.first_byte_written()
                    first_written = True
                yield event(choice)
                offsets[i] += len(chunk.text)
            if include_usage and all(c.result is not None and c.result.error is None for c in completions):
                yield _sse({**envelope, "choices": [], "usage": self._usage(completions)})
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # a server bug mid-stream: the stream still ends in OpenAI's shape, naming the id
            api = self.api
            e = api._http_error(exc, call) if isinstance(exc, MmcastError) else api._internal_error(call)
            yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
            yield b"data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # idle streams only may be closed
            for s in streams:
                await s.aclose()

    def _last_event(self, call, completion: Completion, i: int, event) -> bytes:
        api = self.api
        err = api._ended_badly(completion)
        if err is not None:
            e = api._http_error(err, call)
            return _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        result = completion.result
        return event(
            {
                "index": prompt_lists.choice_index(i, 0, N),
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
