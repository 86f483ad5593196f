"""The OpenAI chat answer: a whole ``chat.completion`` object or its server-sent chunks, with logprobs, usage,
tool calls and the headers every answer carries. Part of the HTTP API (openai_api.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import MmcastError, Unavailable
from scheduler_svc.doors import tool_calls
from scheduler_svc.doors.openai_bodies import FINISH, Call
from scheduler_svc.doors.openai_sse import SSE_HEADERS, ClientGone, joined_chunks, sse_event
from scheduler_svc.engine.completion import Completion


class ChatAnswers:
    """The OpenAI API's translation out (mixed into ``OpenAIApi``)."""

    def _text_of(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.completions.tokenizer.decode([token_id])
        return text

    def _chat_logprobs(self, chunk) -> dict:
        content = []
        for tok, (lp, top) in zip(chunk.token_ids, chunk.logprobs, strict=False):
            s = self._text_of(tok)
            content.append(
                {
                    "token": s,
                    "logprob": lp,
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": self._text_of(t), "logprob": v, "bytes": list(self._text_of(t).encode())}
                        for t, v in top
                    ],
                }
            )
        return {"content": content}

    @staticmethod
    def _usage(completion: Completion) -> dict:
        s = completion.result.summary
        return {
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
        }

    def _ended_badly(self, completion: Completion) -> MmcastError | None:
        """The error to report for a completion that did not finish by itself (failed, or cut by the server)."""
        result = completion.result
        if result.error is not None:
            return result.error
        if result.finish_reason == "cancelled":
            return Unavailable("the server cancelled the request (shutdown or drain deadline); retry")
        return None

    def _envelope(self, call: Call) -> dict:
        kind = "chat.completion" if call.kind == "chat" else "text_completion"
        return {"id": call.object_id, "object": kind, "created": call.created, "model": call.model}

    async def _whole(self, request: Request, call: Call, completion: Completion) -> Response:
        async def collect() -> list:
            return [chunk async for chunk in completion.chunks()]

        try:
            chunks = await self._until_disconnect(request, collect())
        except ClientGone:
            return Response(status_code=499)
        except MmcastError as err:  # failed before its first token
            return self._error(self._http_error(err, call))
        except Exception:
            return self._internal(call)
        err = self._ended_badly(completion)
        if err is not None:
            return self._error(self._http_error(err, call))
        text = "".join(c.text for c in chunks)
        result = completion.result
        choice: dict = {
            "index": 0,
            "finish_reason": FINISH[result.finish_reason],
            "stop_reason": result.stop_reason or None,
        }
        logprobs = completion.sampling.return_logprobs
        choice["message"] = {"role": "assistant", "content": text}
        if call.tools is not None:
            choice["message"], choice["finish_reason"] = tool_calls.whole_answer(
                text, choice["finish_reason"], self.tool_format
            )
        choice["logprobs"] = self._chat_logprobs(joined_chunks(chunks)) if logprobs else None
        out = {**self._envelope(call), "choices": [choice], "usage": self._usage(completion)}
        return JSONResponse(out, headers=self._headers(call, completion))

    async def _stream(self, request: Request, call: Call, completion: Completion, include_usage: bool) -> Response:
        chunks = completion.chunks()
        try:  # the first chunk before the response starts: a request that fails now gets a plain HTTP error
            first = await self._until_disconnect(request, anext(chunks, None))
        except ClientGone:
            await chunks.aclose()
            return Response(status_code=499)
        except MmcastError as err:
            return self._error(self._http_error(err, call))
        except Exception:
            await chunks.aclose()
            return self._internal(call)
        return StreamingResponse(
            self._events(call, completion, chunks, first, include_usage),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **self._headers(call, completion)},
        )

    async def _events(
        self, call: Call, completion: Completion, chunks: AsyncIterator, first, include_usage: bool
    ) -> AsyncIterator[bytes]:
        """Server-sent events in OpenAI's chunk format, ending with ``data: [DONE]``. When the client disconnects,
        Starlette cancels this generator and the request is cancelled with it (Completion.chunks)."""
        envelope = {**self._envelope(call), "object": "chat.completion.chunk"}
        usage_field = {"usage": None} if include_usage else {}
        logprobs = completion.sampling.return_logprobs
        first_written = False
        calls = tool_calls.CallStream(self.tool_format) if call.tools is not None else None

        def event(choice: dict) -> bytes:
            return sse_event({**envelope, "choices": [choice], **usage_field})

        try:
            yield event(
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
            chunk = first
            while chunk is not None:
                text = chunk.text if calls is None else calls.feed(chunk.text)  # tool calls held until the end
                if text or (logprobs and chunk.token_ids):
                    out = event(
                        {
                            "index": 0,
                            "delta": {"content": text},
                            "logprobs": self._chat_logprobs(chunk) if logprobs else None,
                            "finish_reason": None,
                        }
                    )
                    if not first_written:  # handed to the server's transport next, as the gRPC door does
                        completion.first_byte_written()
                        first_written = True
                    yield out
                chunk = await anext(chunks, None)
            err = self._ended_badly(completion)
            if err is not None:
                e = self._http_error(err, call)
                yield sse_event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
            else:
                result = completion.result
                finish = FINISH[result.finish_reason]
                if calls is not None:
                    rest, found = calls.finish()
                    for delta in ({"content": rest} if rest else None, tool_calls.streamed_delta(found)):
                        if delta:
                            yield event({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})
                    finish = "tool_calls" if found else finish
                last = {
                    "index": 0,
                    "finish_reason": finish,
                    "stop_reason": result.stop_reason or None,
                    "logprobs": None,
                    "delta": {},
                }
                yield event(last)
                if include_usage:
                    yield sse_event({**envelope, "choices": [], "usage": self._usage(completion)})
            yield b"data: [DONE]\n\n"
        except Exception as exc:  # a server bug mid-stream: the stream still ends in OpenAI's shape, naming the id
            e = self._http_error(exc, call) if isinstance(exc, MmcastError) else self._internal_error(call)
            yield sse_event({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
            yield b"data: [DONE]\n\n"
        finally:
            await chunks.aclose()
