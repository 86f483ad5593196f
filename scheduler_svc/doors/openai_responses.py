"""``POST /v1/responses``: OpenAI's Responses API, translated onto the same request path as chat completions.

In: ``input`` (a string, or message items whose content is a string or ``input_text`` / ``input_image`` parts;
``output_text`` parts in assistant turns), ``instructions`` (a system turn first, not carried to later responses,
as OpenAI does), ``max_output_tokens``, the sampling fields chat takes, ``previous_response_id`` (the conversation
kept for this tenant: response_store.py) and ``store`` (false: not kept). Out: a ``response`` object with one
``message`` output item, or, streaming, OpenAI's events from ``response.created`` to ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut it, ``response.failed`` when it failed after starting).
Tools, reasoning and non-text output formats are refused, naming the field.
"""

from __future__ import annotations

import json
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from common.errors import MmcastError
from scheduler_svc.doors import openai_schema, response_store
from scheduler_svc.doors.openai_errors import HttpError
from scheduler_svc.doors.openai_sse import SSE_HEADERS, ClientGone
from scheduler_svc.engine.completion import MAX_TOKENS_FIELD, Completion, CompletionRequest
from scheduler_svc.engine.request_input import ImageContent, TextContent, Turn

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _check_unsupported(body: openai_schema.ResponsesBody) -> None:
    fmt = ((body.text or {}).get("format") or {}).get("type", "text")
    refused = [
        ("tools", bool(body.tools)),
        ("tool_choice", body.tool_choice not in (None, "none", "auto")),
        ("reasoning", bool(body.reasoning)),
        ("text.format", fmt != "text"),
    ]
    for name, bad in refused:
        if bad:
            raise HttpError(
                400, f"{name} is not supported by this server; leave it unset", param=name, code="unsupported"
            )


class Responses:
    """The endpoint, on the routes and helpers of ``api`` (an openai_api.OpenAIApi)."""

    def __init__(self, api) -> None:
        self.api = api
        cfg = api.config
        self.store = response_store.ResponseStore(cfg.response_store_entries, cfg.response_store_bytes)

    async def serve(self, request: Request) -> Response:
        api, received, call = self.api, time.monotonic(), None
        try:
            tenant = api._tenant(request)
            body = await api._read(request, openai_schema.ResponsesBody)
            _check_unsupported(body)
            api._check_model(body.model)
            call = api._new_call(request, tenant, body.model, "chat")
            history, turns = await self._conversation(call, body)
            req = CompletionRequest(
                client_id=call.client_id,
                id_reusable=True,
                tenant=tenant,
                sampling=self._sampling(call, body)[0],
                received=received,
                turns=turns,
                default_max_tokens=body.max_output_tokens is None,
                affinity=call.affinity,
            )
            completion = await api._until_disconnect(request, api.completions.admit(req))
            api._keep_inline(call)
        except HttpError as err:
            return api._error(err)
        except MmcastError as err:
            return api._error(api._http_error(err, call))
        except ClientGone:
            return Response(status_code=499)
        except Exception:
            return api._internal(call)
        answer = _Answer(call, body, completion, history)
        if body.stream:
            return await self._stream(request, answer)
        return await self._whole(request, answer)

    # --- translation in ---------------------------------------------------------------------------------------
    def _sampling(self, call, body: openai_schema.ResponsesBody):
        as_chat = openai_schema.ChatCompletionBody(
            model=body.model,
            messages=[{"role": "user", "content": ""}],
            max_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            seed=body.seed,
        )
        spec = self.api._sampling(call, as_chat)
        call.names[MAX_TOKENS_FIELD] = "max_output_tokens"
        return spec

    async def _conversation(self, call, body: openai_schema.ResponsesBody) -> tuple[list[Turn], list[Turn]]:
        """(the kept conversation this one continues, with this request's input; the turns to prompt with)."""
        history: list[Turn] = []
        if body.previous_response_id is not None:
            kept = self.store.get(call.tenant, body.previous_response_id)
            if kept is None:
                raise HttpError(
                    404,
                    f"previous_response_id={body.previous_response_id[:80]!r} names no response this server keeps "
                    "for this tenant (never created, created with store=false, or evicted: "
                    "--response-store-entries, --response-store-bytes)",
                    type="not_found_error",
                    param="previous_response_id",
                    code="response_not_found",
                )
            history = kept
        items = (
            [openai_schema.InputMessage(role="user", content=body.input)] if isinstance(body.input, str) else body.input
        )
        for i, item in enumerate(items):
            history.append(await self._turn(call, item, f"input[{i}]"))
        system = [Turn("system", (TextContent(body.instructions),))] if body.instructions else []
        return history, system + history

    async def _turn(self, call, item: openai_schema.InputMessage, where: str) -> Turn:
        if isinstance(item.content, str):
            return Turn(_ROLES[item.role], (TextContent(item.content),))
        parts = []
        for j, part in enumerate(item.content):
            if part.type == "input_image":
                as_chat = openai_schema.ImageContentPart(
                    type="image_url",
                    image_url=openai_schema.ImageURL(url=part.image_url) if part.image_url is not None else None,
                )
                parts.append(ImageContent(*await self.api._media(call, as_chat, f"{where}.content[{j}]", "image")))
            else:
                parts.append(TextContent(part.text))
        return Turn(_ROLES[item.role], tuple(parts))

    # --- translation out --------------------------------------------------------------------------------------
    async def _whole(self, request: Request, answer: _Answer) -> Response:
        api = self.api

        async def collect() -> list:
            return [chunk async for chunk in answer.completion.chunks()]

        try:
            chunks = await api._until_disconnect(request, collect())
        except ClientGone:
            return Response(status_code=499)
        except MmcastError as err:
            return api._error(api._http_error(err, answer.call))
        except Exception:
            return api._internal(answer.call)
        err = api._ended_badly(answer.completion)
        if err is not None:
            return api._error(api._http_error(err, answer.call))
        answer.text = "".join(c.text for c in chunks)
        self._keep(answer)
        return JSONResponse(answer.response(), headers=api._headers(answer.call, answer.completion))

    def _keep(self, answer: _Answer) -> None:
        if answer.body.store:
            turns = [*answer.history, Turn("assistant", (TextContent(answer.text),))]
            self.store.put(answer.call.tenant, answer.id, response_store.as_references(turns))

    async def _stream(self, request: Request, answer: _Answer) -> Response:
        api = self.api
        chunks = answer.completion.chunks()
        try:  # the first chunk before the response starts: a request that fails now gets a plain HTTP error
            first = await api._until_disconnect(request, anext(chunks, None))
        except Exception as exc:
            await chunks.aclose()
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            if isinstance(exc, MmcastError):
                return api._error(api._http_error(exc, answer.call))
            return api._internal(answer.call)
        return StreamingResponse(
            self._events(answer, chunks, first),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **api._headers(answer.call, answer.completion)},
        )

    async def _events(self, answer: _Answer, chunks, first):
        """OpenAI's streaming events, each ``event: <type>`` with its JSON, numbered by ``sequence_number``."""
        seq = iter(range(1 << 62))
        item = {"item_id": answer.message_id, "output_index": 0, "content_index": 0}

        def event(kind: str, **fields) -> bytes:
            data = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

        try:
            yield event("response.created", response=answer.response(status="in_progress"))
            yield event("response.in_progress", response=answer.response(status="in_progress"))
            yield event(
                "response.output_item.added", output_index=0, item=answer.message(status="in_progress", text="")
            )
            yield event("response.content_part.added", **item, part=_text_part(""))
            chunk, parts = first, []
            while chunk is not None:
                if chunk.text:
                    if not parts:
                        answer.completion.first_byte_written()
                    parts.append(chunk.text)
                    yield event("response.output_text.delta", **item, delta=chunk.text, logprobs=[])
                chunk = await anext(chunks, None)
            answer.text = "".join(parts)
            err = self.api._ended_badly(answer.completion)
            if err is not None:
                e = self.api._http_error(err, answer.call)
                yield event("response.failed", response=answer.response(error={"code": e.code, "message": e.message}))
                return
            yield event("response.output_text.done", **item, text=answer.text, logprobs=[])
            yield event("response.content_part.done", **item, part=_text_part(answer.text))
            yield event("response.output_item.done", output_index=0, item=answer.message())
            self._keep(answer)
            final = answer.response()
            yield event(f"response.{final['status']}", response=final)
        except Exception:  # a server bug mid-stream: the stream still ends in OpenAI's shape, naming the id
            e = self.api._internal_error(answer.call)
            yield event("response.failed", response=answer.response(error={"code": e.code, "message": e.message}))
        finally:
            await chunks.aclose()


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Answer:
    """One response on its way out: its ids, the request's echoes, and the text once known."""

    def __init__(self, call, body: openai_schema.ResponsesBody, completion: Completion, history: list[Turn]) -> None:
        self.call, self.body, self.completion, self.history = call, body, completion, history
        self.id = "resp_" + uuid.uuid4().hex  # unique even when x-request-id is reused: the store's key
        self.message_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.text = ""

    def message(self, status: str = "completed", text: str | None = None) -> dict:
        content = [_text_part(self.text if text is None else text)]
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def response(self, status: str | None = None, error: dict | None = None) -> dict:
        result = self.completion.result
        if status is None:
            status = "failed" if error else "incomplete" if result.finish_reason == "length" else "completed"
        done = status in ("completed", "incomplete")
        body = self.body
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.call.model,
            "output": [self.message("completed" if status == "completed" else "incomplete")] if done else [],
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "store": body.store,
            "metadata": body.metadata or {},
            "usage": None,
        }
        if done:
            s = result.summary
            out["usage"] = {
                "input_tokens": s.prompt_tokens,
                "input_tokens_details": {"cached_tokens": s.cached_tokens},
                "output_tokens": s.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": s.prompt_tokens + s.completion_tokens,
            }
        return out
