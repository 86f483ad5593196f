"""Reading an OpenAI request body: the size limit, the schema's errors as OpenAI field paths, the parameters
accepted at their neutral value only, the video sampling fields, and the body into the shared ``CompletionRequest``
(its sampling spec by the shared checks, request_parsing.py). Part of the HTTP API (openai_api.py)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from common.errors import InvalidArgument
from mmcast.v1 import generation_pb2
from scheduler_svc.doors import grammar_requests, openai_sampling, openai_schema, request_parsing, tool_calls
from scheduler_svc.doors.openai_errors import HttpError
from scheduler_svc.doors.openai_sse import ClientGone
from scheduler_svc.engine import affinity_key
from scheduler_svc.engine.completion import MAX_TOKENS_FIELD, CompletionRequest
from scheduler_svc.engine.request_input import SamplingSpec

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls"}
# Parameters of OpenAI's API that mmcast does not implement: accepted at their neutral value only.
_NEUTRAL = {
    "suffix": (None, ""),
}
_SCHEMA_FIELDS = {
    name
    for model in (
        openai_schema.ChatCompletionBody,
        openai_schema.CompletionBody,
        openai_schema.ChatMessage,
        openai_schema.ImageContentPart,
        openai_schema.TextContentPart,
        openai_schema.ImageURL,
        openai_schema.StreamOptions,
        openai_schema.ToolCall,
        openai_schema.ToolCallFunction,
        openai_schema.ResponsesBody,
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


def check_neutral(body: BaseModel) -> None:
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
class Call:
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
    # (sha256 hex of a data: URL's text, sha256 hex of its bytes) to remember at admission (openai_media.py)
    data_urls: list = dataclasses.field(default_factory=list)
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


class BodyReading:
    """The OpenAI API's translation in: one body -> a ``CompletionRequest`` (mixed into ``OpenAIApi``)."""

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

    def _new_call(self, request: Request, tenant: str, model: str, kind: str) -> Call:
        call = Call(self._client_id(request), tenant, model, kind, {})
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

    async def _completion_request(self, call: Call, body, received: float) -> CompletionRequest:
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

    def _sampling(self, call: Call, body) -> tuple[SamplingSpec, bool]:
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
