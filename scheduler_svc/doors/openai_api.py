"""The OpenAI-compatible HTTP API: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``, as a Starlette application served beside the gRPC API in the scheduler process (http_server.py).

It only translates, as the gRPC servicer does: JSON (validated by openai_schema.py) -> a ``CompletionRequest`` for
the shared request path (completion.py), its chunks -> OpenAI's response objects or server-sent events; errors ->
OpenAI's error shape (openai_errors.py). The limits, tenants, caches and accounting are the gRPC API's own.

Images: ``image_url.url`` is a ``data:image/...;base64,`` URL (remote and local URLs only where the operator allowed
them: media_urls.py), or ``image_url`` is null and ``uuid`` is ``sha256:<hex>`` of an image the server holds — one
uploaded with ``UploadImage`` or sent inline in an earlier request of the same tenant (inline images are kept in
the upload store, within ``--upload-store-bytes``, once their request is admitted).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from common.errors import IMAGE_RESOURCE, InvalidArgument, MmcastError, NotFound, Status, Unavailable
from common.families.tool_calls import tool_calls_of
from mmcast.v1 import generation_pb2
from scheduler_svc.doors import (
    grammar_requests,
    media_aliases,
    openai_errors,
    openai_sampling,
    openai_schema,
    request_parsing,
    tool_calls,
)
from scheduler_svc.doors.http_server import HTTP_ROUTES
from scheduler_svc.doors.openai_choices import Choices
from scheduler_svc.doors.openai_completions import TextCompletions
from scheduler_svc.doors.openai_errors import HttpError
from scheduler_svc.doors.openai_responses import Responses
from scheduler_svc.doors.openai_sse import SSE_HEADERS, ClientGone, joined_chunks, sse_event
from scheduler_svc.engine import affinity_key
from scheduler_svc.engine.completion import MAX_TOKENS_FIELD, Completion, CompletionRequest, Completions
from scheduler_svc.engine.request_input import ImageContent, SamplingSpec, TextContent, Turn, VideoContent

log = logging.getLogger(__name__)

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
# Parameters of OpenAI's API that mmcast does not implement: accepted at their neutral value only.
_NEUTRAL = {
    "suffix": (None, ""),
}
_SCHEMA_FIELDS = {
    name
    for model in (
        openai_schema.ChatCompletionRequest,
        openai_schema.CompletionRequest,
        openai_schema.ChatMessage,
        openai_schema.ImageContentPart,
        openai_schema.TextContentPart,
        openai_schema.ImageURL,
        openai_schema.StreamOptions,
        openai_schema.ToolCall,
        openai_schema.ToolCallFunction,
        openai_schema.ResponsesRequest,
        openai_schema.InputMessage,
        openai_schema.InputImage,
    )
    for name in model.model_fields
}


def _param(loc: tuple) -> str:
    """A pydantic error location as a field path: ``messages[0].content[1].image_url``, without the union-member
    labels (``str``, ``list[...]``) and the content part's discriminator tag pydantic puts in it."""
    parts: list[str] = []
    tag_pending = False  # just past a content part's index: the next field-like segment is its type tag
    for seg in loc:
        if isinstance(seg, int):
            tag_pending = len(parts) >= 1 and parts[-1] == ".content"
            parts.append(f"[{seg}]")
        elif seg in _SCHEMA_FIELDS:
            if tag_pending:
                tag_pending = False
                continue
            parts.append(("." if parts else "") + seg)
    return "".join(parts).lstrip(".")


def _validation_error(exc: ValidationError) -> HttpError:
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        e = next(e for e in errors if e["type"] == "json_invalid")
        return HttpError(400, f"the request body is not valid JSON: {e['msg']}", code="invalid_json")
    e = max(errors, key=lambda e: len(e["loc"]))  # the most specific of a union's alternatives
    param = _param(e["loc"]) or None
    shown = repr(e.get("input"))[:80] if e["type"] != "missing" else ""
    message = f"{param}: {e['msg']}" + (f" (got {shown})" if shown else "") if param else e["msg"]
    return HttpError(400, message, param=param, code="invalid_value")


def _check_neutral(body: BaseModel) -> None:
    for name, neutral in _NEUTRAL.items():
        value = getattr(body, name, None)
        if value not in neutral:
            raise HttpError(
                400,
                f"{name}={str(value)[:80]} is not supported by this server; leave it unset",
                param=name,
                code="unsupported",
            )


@dataclasses.dataclass
class _Call:
    """One HTTP request on its way through the shared path."""

    client_id: str  # the request id (x-request-id, else made up): echoed, and the response object's id
    tenant: str
    model: str
    kind: str  # "chat" | "text"
    names: dict  # gRPC field path -> this request's field name, for error messages
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    uuid_fields: dict = dataclasses.field(default_factory=dict)  # sha256 hex -> (the field, the uuid as sent)
    aliases: list = dataclasses.field(default_factory=list)  # (free-form uuid, sha256 hex) to register at admission
    inline: list = dataclasses.field(default_factory=list)  # (sha256 hex, bytes) of images sent inline
    affinity: str = ""  # the conversation key the client's headers chose ("" none: computed at admission)
    tools: tool_calls.ToolRequest | None = None  # tools whose calls the answer is searched for (tool_calls.py)
    prompts: list = dataclasses.field(default_factory=list)  # /v1/completions: the prompts, for echo

    @property
    def object_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.client_id


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI's legacy default; vLLM's too)
_VIDEO_KEYS = ("fps", "num_frames", "max_frames", "min_pixels", "max_pixels")


def _video_options(body):
    """The video sampling a chat request asks for, from vLLM's ``mm_processor_kwargs`` (``fps``, ``num_frames``,
    ``max_frames``, ``min_pixels``, ``max_pixels``; also the processor's ``size`` as ``{shortest_edge,
    longest_edge}``) and ``media_io_kwargs.video`` (``fps``, ``num_frames``); None when it asks for none. A key mmcast
    does not read is refused, naming it, rather than dropped."""
    values: dict[str, Any] = {}
    for name, given in (("mm_processor_kwargs", body.mm_processor_kwargs), ("media_io_kwargs", body.media_io_kwargs)):
        if not given:
            continue
        where, allowed, unknown = name, _VIDEO_KEYS, []
        if name == "media_io_kwargs":
            unknown = sorted(k for k in given if k != "video")
            given, where, allowed = given.get("video") or {}, f"{name}.video", ("fps", "num_frames")
        if not isinstance(given, dict):
            raise HttpError(400, f"{where} must be an object", param=where, code="invalid_type")
        given = dict(given)
        size = given.pop("size", None) if name == "mm_processor_kwargs" else None
        if isinstance(size, dict):
            given.setdefault("min_pixels", size.get("shortest_edge"))
            given.setdefault("max_pixels", size.get("longest_edge"))
        unknown += sorted(f"{where}.{k}" for k in given if k not in allowed)
        if unknown:
            raise HttpError(
                400,
                f"{name}: {', '.join(unknown)} not supported; mmcast reads {', '.join(allowed)}",
                param=name,
                code="unsupported",
            )
        for key, value in given.items():
            if value is None:
                continue
            integer = key != "fps"
            if isinstance(value, bool) or not isinstance(value, int | float) or (integer and value != int(value)):
                kind = "an integer" if integer else "a number"
                raise HttpError(
                    400, f"{where}.{key}={value!r} must be {kind}", param=f"{where}.{key}", code="invalid_type"
                )
            values[key] = int(value) if integer else float(value)
    if not values:
        return None
    return request_parsing.video_options("mm_processor_kwargs", **{k: values.get(k) for k in _VIDEO_KEYS})


class OpenAIApi:
    """The routes. ``tokens`` (common.auth.TokenTable or None) and tenants are exactly the gRPC API's."""

    def __init__(
        self,
        *,
        completions: Completions,
        uploads,
        media,
        model_name: str,
        tokens=None,
        max_body_bytes: int,
        metrics_registry=None,
    ) -> None:
        self.completions = completions
        self.frontend = completions.frontend
        self.config = completions.config
        self.uploads = uploads
        self.media = media  # media_urls.MediaLoader
        self.model_name = model_name
        self.tokens = tokens
        self.max_body_bytes = max_body_bytes
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self.tool_format = tool_calls_of(self.frontend.family.tool_format)  # the family's tool-call parser
        self.text = TextCompletions(self)  # /v1/completions: prompt lists, token-id prompts, echo
        self.responses = Responses(self)  # /v1/responses, with its previous_response_id store
        self.aliases = media_aliases.MediaAliases()  # caller-chosen uuids, per tenant
        self.metrics_registry = metrics_registry  # the scheduler's, served at /metrics too (None: no route)

    def app(self, middleware=None) -> Starlette:
        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.text_completions, methods=["POST"]),
            Route("/v1/responses", self.responses.serve, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ]
        if self.metrics_registry is not None:
            from scheduler_svc.doors.http_metrics_route import MetricsRoute

            routes.append(Route("/metrics", MetricsRoute(self, self.metrics_registry).serve, methods=["GET"]))
        app = Starlette(
            routes=routes,
            middleware=middleware or [],
            exception_handlers={404: self._not_found, 405: self._method_not_allowed},
        )
        return app

    # --- routes -----------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.completions.engine.ready and not self.completions.draining:
            return Response(status_code=200)
        why = "draining for shutdown" if self.completions.draining else "the worker group is not serving"
        return self._error(HttpError(503, f"not ready: {why}", type="service_unavailable_error", code="unavailable"))

    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
        except MmcastError as err:
            return self._error(openai_errors.from_mmcast(err))
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "mmcast",
            "max_model_len": self.completions.engine.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    async def text_completions(self, request: Request) -> Response:
        return await self._serve(request, "text")

    async def _serve(self, request: Request, kind: str) -> Response:
        received = time.monotonic()
        call: _Call | None = None
        try:
            tenant = self._tenant(request)
            schema = openai_schema.ChatCompletionRequest if kind == "chat" else openai_schema.CompletionRequest
            body = await self._read(request, schema)
            _check_neutral(body)
            openai_sampling.check_choices(body, self.config.max_choices)
            self._check_model(body.model)
            call = self._new_call(request, tenant, body.model, kind)
            if kind == "text":
                completion = await self.text.admit(request, call, body, received)
            else:
                req = await self._completion_request(call, body, received)
                if body.n > 1 and call.tools is not None:
                    raise HttpError(
                        400,
                        f"n={body.n} with tools is not served: each choice's tool calls would need a parser of its "
                        "own; send n=1 (or omit it) with tools, or tool_choice=none",
                        param="n",
                        code="unsupported",
                    )
                if body.n > 1:
                    choices = Choices(self, call, body, req)
                    first = await self._until_disconnect(request, choices.admit())
                else:
                    completion = await self._until_disconnect(request, self.completions.admit(req))
                self._keep_inline(call)
        except HttpError as err:
            return self._error(err)
        except MmcastError as err:
            log.info(
                "request rejected: %s",
                err.message,
                extra={"request_id": call.client_id if call else "", "code": err.status.value},
            )
            return self._error(self._http_error(err, call))
        except ClientGone:
            return Response(status_code=499)
        except Exception:
            return self._internal(call)
        if kind == "text":
            return await self.text.respond(request, call, body, completion)
        include_usage = bool(body.stream and body.stream_options and body.stream_options.include_usage)
        if body.n > 1:
            return choices.stream(first, include_usage) if body.stream else await choices.whole(request, first)
        if body.stream:
            return await self._stream(request, call, completion, include_usage)
        return await self._whole(request, call, completion)

    # --- translation in ---------------------------------------------------------------------------------------
    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise HttpError(
                404,
                f"the model {model[:120]!r} does not exist here; this server serves {self.model_name!r} "
                "(GET /v1/models)",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    def _new_call(self, request: Request, tenant: str, model: str, kind: str) -> _Call:
        call = _Call(self._client_id(request), tenant, model, kind, {})
        try:
            call.affinity = affinity_key.client_key(request.headers.get)
        except InvalidArgument as err:
            raise HttpError(400, err.message, param=err.fields[0], code="invalid_value") from None
        return call

    async def _read(self, request: Request, schema: type[BaseModel]) -> BaseModel:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise HttpError(
                413,
                f"the request body has {declared} bytes; the limit is {limit} (--max-request-bytes)",
                code="request_too_large",
            )
        parts, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise HttpError(
                        413, f"the request body exceeds {limit} bytes (--max-request-bytes)", code="request_too_large"
                    )
                parts.append(chunk)
        except ClientDisconnect:
            raise ClientGone() from None
        data = b"".join(parts)
        parts.clear()
        if not data:
            raise HttpError(400, "the request body is empty: send a JSON object", code="invalid_json")
        try:
            return schema.model_validate_json(data)
        except ValidationError as exc:
            raise _validation_error(exc) from None

    async def _completion_request(self, call: _Call, body, received: float) -> CompletionRequest:
        request_parsing.check_cache_salt(body.cache_salt or "")
        sampling, default_max = self._sampling(call, body)
        tools, grammar = (None, grammar_requests.from_openai(body))
        if call.kind == "chat":
            tools, grammar = tool_calls.request_grammar(body, self.tool_format)
            call.tools = tools if tools is not None and tools.parse_calls else None
        common = dict(
            client_id=call.client_id,
            id_reusable=True,
            tenant=call.tenant,
            sampling=sampling,
            received=received,
            cache_salt=body.cache_salt or "",
            default_max_tokens=default_max,
            affinity=call.affinity,
            grammar=grammar,
        )
        turns = await self._turns(call, body.messages, _video_options(body))
        if (
            body.continue_final_message
            and body.add_generation_prompt
            and "add_generation_prompt" in body.model_fields_set
        ):
            raise HttpError(
                400,
                "continue_final_message and add_generation_prompt cannot both be true: continuing the last message "
                "leaves its turn open, a generation prompt starts a new one",
                param="continue_final_message",
                code="invalid_value",
            )
        add_generation_prompt = body.add_generation_prompt and not body.continue_final_message
        return CompletionRequest(
            turns=turns,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tools=tools.tools if tools is not None else (),
            **common,
        )

    def _sampling(self, call: _Call, body) -> tuple[SamplingSpec, bool]:
        """The shared checks (request_parsing.parse_sampling) on this body's values; errors are renamed to the
        body's field names."""
        if call.kind == "chat":
            max_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            if body.top_logprobs is not None and body.top_logprobs > 0 and not body.logprobs:
                raise HttpError(400, "top_logprobs needs logprobs=true", param="top_logprobs", code="invalid_value")
            return_logprobs, top = body.logprobs, body.top_logprobs or 0
            call.names.update({"sampling.logprobs": "top_logprobs", MAX_TOKENS_FIELD: max_name})
        else:
            # /v1/completions: OpenAI's and vLLM's default is 16 tokens, not what the context leaves
            max_name, max_tokens = (
                "max_tokens",
                COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
            )
            return_logprobs, top = body.logprobs is not None, body.logprobs or 0
            call.names.update({"sampling.logprobs": "logprobs", "messages": "prompt"})
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
        p = generation_pb2.SamplingParams(
            max_tokens=max_tokens or 1,  # unset: the context decides after tokenizing (CompletionRequest)
            temperature=1.0 if body.temperature is None else body.temperature,
            stop=stop,
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            logprobs=top,
            return_logprobs=return_logprobs,
        )
        if body.top_p is not None:
            p.top_p = body.top_p
        if body.seed is not None:
            p.seed = body.seed % 2**64  # the ranks reduce seeds modulo 2^64: a negative seed is as good as any
        if body.top_k is not None and body.top_k > 0:  # vLLM: -1 and 0 mean no cut
            p.top_k = body.top_k
        openai_sampling.penalties_into(body, p)
        spec = request_parsing.parse_sampling(
            p,
            max_tokens_limit=self.config.max_tokens_limit,
            max_logprobs=self.config.max_logprobs,
            vocab_size=self.frontend.vocab_size,
            max_tokens_known=max_tokens is not None,
        )
        if spec.return_logprobs != return_logprobs:  # logprobs > 0 implies them on gRPC; here only when asked
            spec = dataclasses.replace(spec, return_logprobs=return_logprobs)
        return spec, max_tokens is None

    async def _turns(self, call: _Call, messages, video_options=None) -> list[Turn]:
        turns = []
        for i, m in enumerate(messages):
            calls = tool_calls.turn_calls(m, i)
            if m.content is None and not calls:
                raise HttpError(
                    400,
                    f"messages[{i}].content is missing: send text or image parts (or, from the assistant, tool_calls)",
                    param=f"messages[{i}].content",
                    code="invalid_value",
                )
            parts: list[TextContent | ImageContent | VideoContent] = []
            content = (
                [openai_schema.TextContentPart(type="text", text=m.content)]
                if isinstance(m.content, str)
                else m.content or []
            )
            for j, part in enumerate(content):
                if part.type == "text":
                    parts.append(TextContent(part.text))
                elif part.type == "video_url":
                    parts.append(await self._video(call, part, f"messages[{i}].content[{j}]", video_options))
                else:
                    parts.append(await self._image(call, part, f"messages[{i}].content[{j}]"))
            turns.append(Turn(_ROLES[m.role], tuple(parts), calls))
        return turns

    async def _video(self, call: _Call, part, where: str, options) -> VideoContent:
        """A ``video_url`` part: the same sources as an image, sampled as the request's video options say."""
        if options is None:
            options = request_parsing.video_options(
                f"{where}.video_url", fps=None, num_frames=None, max_frames=None, min_pixels=None, max_pixels=None
            )
        data, digest, field = await self._media(call, part, where, "video")
        return VideoContent(data, digest, field, options)

    async def _image(self, call: _Call, part, where: str) -> ImageContent:
        return ImageContent(*await self._media(call, part, where, "image"))

    async def _media(self, call: _Call, part, where: str, kind: str) -> tuple[bytes | None, str | None, str]:
        """An ``image_url`` / ``video_url`` part as (bytes, None, field) — a ``data:`` URL, or a remote or local URL
        where allowed — or as (None, sha256 hex, field) when the URL is null and ``uuid`` names a file the server
        holds. A ``sha256:`` uuid beside bytes must be their sha256; a free-form one beside bytes names them for the
        tenant's later requests (media_aliases.py). The bytes are hashed once here."""
        field = f"{where}.{kind}_url"
        url = getattr(part, f"{kind}_url")
        digest, alias = self._uuid_digest(part, where)
        if url is None and alias is not None:
            digest = self.aliases.lookup(call.tenant, alias)
            if digest is None:
                raise HttpError(
                    404,
                    f"{where}.uuid={alias!r} names no {kind} this tenant sent with that uuid (or it was evicted); "
                    f"send the {kind} with its uuid again",
                    type="not_found_error",
                    param=f"{where}.uuid",
                    code=f"{kind}_not_found",
                )
        if url is None:
            if digest is None:
                raise HttpError(
                    400,
                    f"{field} is null and {where}.uuid is not set: send the {kind} as a URL, or "
                    "reference one the server holds by its uuid",
                    param=field,
                    code="invalid_value",
                )
            call.uuid_fields[digest] = (f"{where}.uuid", part.uuid)
            return None, digest, field
        data = await self.media.load(url.url, f"{field}.url", kind)  # a large data: URL decodes off the loop
        sha = hashlib.sha256(data).hexdigest()
        if digest is not None and digest != sha:
            raise HttpError(
                400,
                f"{where}.uuid=sha256:{digest} does not match the sha256 of the file's bytes ({sha})",
                param=f"{where}.uuid",
                code="invalid_value",
            )
        call.inline.append((sha, data))
        if alias is not None:
            call.aliases.append((alias, sha))
        return data, None, field

    @staticmethod
    def _uuid_digest(part, where: str) -> tuple[str | None, str | None]:
        """(sha256 hex, None) for a ``sha256:<hex>`` uuid, (None, the id) for a free-form one, (None, None) without."""
        if part.uuid is None:
            return None, None
        try:
            return media_aliases.parse_uuid(part.uuid)
        except media_aliases.BadUuid as exc:
            raise HttpError(
                400, f"{where}.uuid={part.uuid[:80]!r} {exc}", param=f"{where}.uuid", code="invalid_value"
            ) from None

    def _keep_inline(self, call: _Call) -> None:
        """Admitted: its inline images become referable by uuid in later requests of the tenant."""
        for sha, data in call.inline:
            try:
                self.uploads.put(data, sha256_hex=sha, tenant=call.tenant)
            except MmcastError:  # larger than the whole store: it stays usable inline only
                pass
        call.inline.clear()
        for alias, sha in call.aliases:
            self.aliases.register(call.tenant, alias, sha)
        call.aliases.clear()

    # --- translation out --------------------------------------------------------------------------------------
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

    def _envelope(self, call: _Call) -> dict:
        kind = "chat.completion" if call.kind == "chat" else "text_completion"
        return {"id": call.object_id, "object": kind, "created": call.created, "model": call.model}

    async def _whole(self, request: Request, call: _Call, completion: Completion) -> Response:
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
            "finish_reason": _FINISH[result.finish_reason],
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

    async def _stream(self, request: Request, call: _Call, completion: Completion, include_usage: bool) -> Response:
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
        self, call: _Call, completion: Completion, chunks: AsyncIterator, first, include_usage: bool
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
                finish = _FINISH[result.finish_reason]
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

    # --- helpers ----------------------------------------------------------------------------------------------
    @staticmethod
    def _headers(call: _Call, completion: Completion) -> dict:
        """An answer's headers: its request id, and the conversation key for a client routing through a proxy
        (it sends it back as the x-mmcast-affinity request header on later turns: affinity_key.py)."""
        return {"x-request-id": call.client_id, affinity_key.AFFINITY_HEADER: completion.affinity}

    def _tenant(self, request: Request) -> str:
        if self.tokens is None:
            return ""
        tenant, problem = self.tokens.authenticate(
            [("authorization", v) for v in request.headers.getlist("authorization")]
        )
        if tenant is None:
            raise MmcastError(problem.replace("metadata", "header"), Status.UNAUTHENTICATED)
        return tenant

    @staticmethod
    def _client_id(request: Request) -> str:
        """The request id to echo: x-request-id, else one made up. A label here, which clients may reuse
        (CompletionRequest.id_reusable)."""
        given = request.headers.get("x-request-id", "")
        try:
            request_parsing.check_request_id(given)
        except InvalidArgument as err:
            raise HttpError(
                400,
                err.message.replace("request_id", "the x-request-id header"),
                param="x-request-id",
                code="invalid_value",
            ) from None
        return given or uuid.uuid4().hex

    @staticmethod
    async def _until_disconnect(request: Request, awaitable):
        """``awaitable``'s result, or ``ClientGone`` (with the awaitable cancelled) if the client disconnects
        first: a client that leaves while its request waits for the model cancels it."""
        work = asyncio.ensure_future(awaitable)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        watch = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            work.cancel()
            try:
                await work
            except (asyncio.CancelledError, Exception):
                pass
            raise ClientGone()
        return work.result()

    def _http_error(self, err: MmcastError, call: _Call | None) -> HttpError:
        names = call.names if call else {}
        if (
            isinstance(err, NotFound)
            and err.resource is not None
            and err.resource.type == IMAGE_RESOURCE
            and call
            and err.resource.name in call.uuid_fields
        ):
            field, given = call.uuid_fields[err.resource.name]
            return HttpError(
                404,
                f"{field}={given} names no image this server holds (never "
                "sent or uploaded by this tenant, or evicted from the upload store, "
                "--upload-store-bytes); send the image itself",
                type="not_found_error",
                param=field,
                code="image_not_found",
            )
        return openai_errors.from_mmcast(err, names)

    @staticmethod
    def _error(err: HttpError) -> Response:
        return Response(
            openai_errors.body(err.message, err.type, err.param, err.code),
            status_code=err.status,
            media_type="application/json",
            headers=err.headers,
        )

    def _internal(self, call: _Call | None) -> Response:
        return self._error(self._internal_error(call))

    @staticmethod
    def _internal_error(call: _Call | None) -> HttpError:
        """Logs the exception being handled under the request id; the client gets the id, not the exception."""
        request_id = call.client_id if call else f"http-{uuid.uuid4().hex}"
        log.exception("unexpected error in the HTTP API", extra={"request_id": request_id})
        return HttpError(
            500,
            f"internal server error (request_id={request_id}); the server log records the cause under this id",
            type="server_error",
            code="internal",
        )

    async def _not_found(self, request: Request, exc) -> Response:
        return self._error(
            HttpError(
                404,
                f"no route {request.url.path[:200]!r}; this server serves "
                f"{', '.join(HTTP_ROUTES[:-1])} and {HTTP_ROUTES[-1]}",
                type="not_found_error",
                code="not_found",
            )
        )

    async def _method_not_allowed(self, request: Request, exc) -> Response:
        return self._error(
            HttpError(405, f"{request.method} is not allowed on {request.url.path[:200]}", code="method_not_allowed")
        )
