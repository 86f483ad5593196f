"""``n`` > 1 on the OpenAI chat endpoint: several choices of one prompt, computed from one prefill
(``/v1/completions`` admits its choices the same way: openai_completions.py).

The first choice (the leader) is admitted alone; the others (the followers) are admitted once its first token is
out, when its prompt's full blocks are registered in the prefix cache, so each follower reads them as a prefix hit
and computes only the prompt's last partial block. Each choice is an ordinary request of the shared path
(completion.py): id ``<request id>.<index>`` for a follower, seed ``seed + index`` (modulo 2^64) when the client gave
one (vLLM's rule, so a seeded request is reproducible choice by choice), otherwise a seed of its own.

Usage is counted as OpenAI counts it: the prompt once, the completion tokens of every choice summed; ``cached_tokens``
is the largest prefix hit of any choice (the followers' when the prompt was new), never more than the prompt.
A choice that fails fails the whole answer (the others are cancelled), as a single request's failure would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import MmcastError
from scheduler_svc.doors.openai_sse import SSE_HEADERS, ClientGone, joined_chunks, sse_event
from scheduler_svc.engine.completion import Completion, CompletionRequest

_DONE = object()  # a choice's chunks are exhausted


def follower_request(req: CompletionRequest, index: int) -> CompletionRequest:
    """Choice ``index``'s request: its own id and, for a seeded request, seed + index."""
    seed = req.sampling.seed
    sampling = req.sampling if seed is None else dataclasses.replace(req.sampling, seed=(seed + index) % 2**64)
    return dataclasses.replace(req, client_id=f"{req.client_id}.{index}", sampling=sampling)


def usage(completions: list[Completion]) -> dict:
    summaries = [c.result.summary for c in completions]
    prompt = summaries[0].prompt_tokens
    out = sum(s.completion_tokens for s in summaries)
    cached = max(s.cached_tokens for s in summaries)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "total_tokens": prompt + out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class Choices:
    """Serves one HTTP call with ``n`` choices through ``api`` (openai_api.OpenAIApi: its translation helpers)."""

    def __init__(self, api, call, body, req: CompletionRequest) -> None:
        self.api, self.call, self.body, self.req = api, call, body, req
        self.completions: list[Completion] = []
        self.iters: list[AsyncIterator] = []

    async def admit(self) -> object:
        """Admits every choice; returns the leader's first chunk (None if it ended without one). Raises the
        ``MmcastError`` of a choice refused or failed before its first token, with every admitted choice cancelled."""
        try:
            leader = await self.api.completions.admit(self.req)
            self.completions.append(leader)
            self.iters.append(leader.chunks())
            first = await anext(self.iters[0], None)  # its prompt blocks are registered once a token is out
            for i in range(1, self.body.n):
                follower = await self.api.completions.admit(follower_request(self.req, i))
                self.completions.append(follower)
                self.iters.append(follower.chunks())
            return first
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        for it in self.iters:
            await it.aclose()  # an unfinished choice is cancelled (Completion.chunks)

    async def events(self, first) -> AsyncIterator[tuple[int, object]]:
        """``(choice index, chunk)`` in arrival order across the choices, then ``(index, _DONE)`` per choice."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, it: AsyncIterator) -> None:
            try:
                async for chunk in it:
                    await queue.put((index, chunk))
                await queue.put((index, _DONE))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which ends the answer
                await queue.put((index, exc))

        if first is not None:
            await queue.put((0, first))
        tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(self.iters)]
        left = len(tasks)
        try:
            while left:
                index, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is _DONE:
                    left -= 1
                yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # no generator is still running when closed
            await self.close()

    def _error_of_any(self) -> MmcastError | None:
        for c in self.completions:
            err = self.api._ended_badly(c)
            if err is not None:
                return err
        return None

    def _choice(self, index: int, chunks: list, finish: dict) -> dict:
        api, completion = self.api, self.completions[index]
        text = "".join(c.text for c in chunks)
        choice: dict = {"index": index, **finish}
        logprobs = completion.sampling.return_logprobs
        choice["message"] = {"role": "assistant", "content": text}
        choice["logprobs"] = api._chat_logprobs(joined_chunks(chunks)) if logprobs else None
        return choice

    async def whole(self, request: Request, first) -> Response:
        api, call = self.api, self.call
        got: list[list] = [[] for _ in self.completions]

        async def collect() -> None:
            async for index, chunk in self.events(first):
                if chunk is not _DONE:
                    got[index].append(chunk)

        try:
            await api._until_disconnect(request, collect())
        except ClientGone:
            return Response(status_code=499)
        except MmcastError as err:
            return api._error(api._http_error(err, call))
        except Exception:
            return api._internal(call)
        err = self._error_of_any()
        if err is not None:
            return api._error(api._http_error(err, call))
        choices = [self._choice(i, got[i], _finish(c)) for i, c in enumerate(self.completions)]
        out = {**api._envelope(call), "choices": choices, "usage": usage(self.completions)}
        return JSONResponse(out, headers=api._headers(call, self.completions[0]))

    def stream(self, first, include_usage: bool) -> Response:
        api, call = self.api, self.call
        return StreamingResponse(
            self._sse(first, include_usage),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **api._headers(call, self.completions[0])},
        )

    async def _sse(self, first, include_usage: bool) -> AsyncIterator[bytes]:
        api, call = self.api, self.call
        envelope = {**api._envelope(call), "object": "chat.completion.chunk"}
        usage_field = {"usage": None} if include_usage else {}

        def event(choice: dict) -> bytes:
            return sse_event({**envelope, "choices": [choice], **usage_field})

        try:
            for i in range(len(self.completions)):
                yield event(
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                )
            async with contextlib.aclosing(self.events(first)) as events:
                async for i, chunk in events:
                    if chunk is _DONE:
                        err = api._ended_badly(self.completions[i])
                        if err is not None:
                            raise err
                        yield event({"index": i, **_finish(self.completions[i]), "logprobs": None, "delta": {}})
                        continue
                    logprobs = self.completions[i].sampling.return_logprobs
                    if not (chunk.text or (logprobs and chunk.token_ids)):
                        continue
                    lp = api._chat_logprobs(chunk) if logprobs else None
                    yield event({"index": i, "delta": {"content": chunk.text}, "logprobs": lp, "finish_reason": None})
            if include_usage:
                yield sse_event({**envelope, "choices": [], "usage": usage(self.completions)})
        except MmcastError as exc:
            e = api._http_error(exc, call)
            yield sse_event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        except Exception:  # a server bug mid-stream: the stream still ends in OpenAI's shape, naming the id
            e = api._internal_error(call)
            yield sse_event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
        yield b"data: [DONE]\n\n"


def _finish(completion: Completion) -> dict:
    result = completion.result
    reason = {"stop": "stop", "length": "length"}.get(result.finish_reason, result.finish_reason)
    return {"finish_reason": reason, "stop_reason": result.stop_reason or None}
