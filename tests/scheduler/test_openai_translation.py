"""The HTTP API's translations, without a server: internal errors -> OpenAI's status codes and bodies (one table,
docs/ERRORS.md), pydantic locations -> field paths, the shared sampling checks under the HTTP body's names."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from common.errors import (
    IMAGE_RESOURCE,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    MmcastError,
    NotFound,
    Resource,
    ResourceExhausted,
    Status,
    Unavailable,
)
from scheduler_svc.doors import openai_bodies, openai_errors, openai_schema


@pytest.mark.parametrize(
    ("err", "status", "kind", "retry_after"),
    [
        (InvalidArgument("x"), 400, "invalid_request_error", None),
        (FailedPrecondition("x"), 400, "invalid_request_error", None),
        (MmcastError("x", Status.UNAUTHENTICATED), 401, "authentication_error", None),
        (MmcastError("x", Status.PERMISSION_DENIED), 403, "permission_error", None),
        (NotFound("x", resource=Resource(IMAGE_RESOURCE, "ab")), 404, "not_found_error", None),
        (AlreadyExists("x"), 409, "conflict_error", None),
        (
            ResourceExhausted("image over the limit", field="messages[0].content[0].image_url"),
            413,
            "invalid_request_error",
            None,
        ),
        (ResourceExhausted("queue full (--max-waiting)", retry_after=1.0), 429, "rate_limit_error", "1"),
        (ResourceExhausted("uploads pending", retry_after=2.5), 429, "rate_limit_error", "3"),
        (Unavailable("group down", retry_after=0.2), 503, "service_unavailable_error", "1"),
        (Unavailable("draining"), 503, "service_unavailable_error", "1"),
        (MmcastError("bug"), 500, "server_error", None),
    ],
)
def test_status_table(err, status, kind, retry_after):
    http = openai_errors.from_mmcast(err)
    assert (http.status, http.type, http.code) == (status, kind, err.status.value.lower())
    assert http.headers.get("Retry-After") == retry_after
    body = json.loads(openai_errors.body(http.message, http.type, http.param, http.code))
    assert set(body["error"]) == {"message", "type", "param", "code"}


def test_field_names_are_the_bodys():
    err = InvalidArgument(
        "messages and sampling.max_tokens: 9 prompt tokens + 100 to generate (sampling.max_tokens=100) = 109 tokens, "
        "over the context of 64 tokens (--max-model-len / the model's max_position_embeddings); send a shorter prompt "
        "or set sampling.max_tokens to at most 55",
        field=("messages", "sampling.max_tokens"),
    )
    http = openai_errors.from_mmcast(err, {"sampling.max_tokens": "max_completion_tokens"})
    assert http.param == "messages"
    assert "max_completion_tokens=100" in http.message and "sampling." not in http.message
    http = openai_errors.from_mmcast(
        InvalidArgument("sampling.temperature=3.0 must be in [0, 2]", field="sampling.temperature")
    )
    assert (http.param, http.message) == ("temperature", "temperature=3.0 must be in [0, 2]")


def _error_of(body: dict) -> openai_errors.HttpError:
    with pytest.raises(ValidationError) as info:
        openai_schema.ChatCompletionBody.model_validate_json(json.dumps(body))
    return openai_bodies._validation_error(info.value)


@pytest.mark.parametrize(
    ("content", "param"),
    [
        ([{"type": "text"}], "messages[0].content[0].text"),
        (
            [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
            "messages[0].content[1].image_url.url",
        ),
        ([{"type": "image_url", "image_url": {"url": 5}}], "messages[0].content[0].image_url.url"),
        ([{"type": "image_url", "uuid": 7}], "messages[0].content[0].uuid"),
        ([{"type": "audio"}], "messages[0].content[0]"),
        (5, "messages[0].content"),
    ],
)
def test_validation_error_paths(content, param):
    err = _error_of({"model": "m", "messages": [{"role": "user", "content": content}]})
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(param + ": ")


def test_validation_error_top_level():
    assert _error_of({"model": "m", "messages": [], "stop": [1]}).param in ("messages", "stop[0]")
    assert _error_of({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}).param == "n"
    with pytest.raises(ValidationError) as info:
        openai_schema.ChatCompletionBody.model_validate_json(b'{"model": ')
    assert openai_bodies._validation_error(info.value).code == "invalid_json"


def test_unknown_fields_are_ignored_and_neutral_values_accepted():
    body = openai_schema.ChatCompletionBody.model_validate_json(
        json.dumps(
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "some_future_field": {"a": 1},
                "presence_penalty": 0,
                "frequency_penalty": 0.0,
                "logit_bias": {},
                "tools": [],
                "tool_choice": "none",
                "response_format": {"type": "text"},
            }
        )
    )
    openai_bodies.check_neutral(body)  # nothing refused
    # the rest of OpenAI's parameters are served; a completion's suffix is accepted only at its neutral value
    for field, value in [("suffix", "x")]:
        body = openai_schema.CompletionBody.model_validate_json(json.dumps({"model": "m", "prompt": "x", field: value}))
        with pytest.raises(openai_errors.HttpError) as info:
            openai_bodies.check_neutral(body)
        assert info.value.param == field and info.value.code == "unsupported"
