"""The OpenAI body's sampling fields that the gRPC request has no twin for, translated or refused: ``n`` and
``best_of`` (the choices, openai_choices.py), and the penalties written into the shared ``SamplingParams``, whose
ranges request_parsing checks for both APIs (common/penalties.py)."""

from __future__ import annotations

import re

from mmcast.v1 import generation_pb2
from scheduler_svc.doors.openai_errors import HttpError


def check_choices(body, max_choices: int) -> None:
    if body.n > max_choices:
        raise HttpError(
            400, f"n={body.n} exceeds the limit {max_choices} (--max-choices)", param="n", code="invalid_value"
        )
    if body.best_of is not None and body.best_of != body.n:
        raise HttpError(
            400,
            f"best_of={body.best_of} must equal n={body.n}: this server returns every choice it generates",
            param="best_of",
            code="unsupported",
        )


def penalties_into(body, p: generation_pb2.SamplingParams) -> None:
    """The body's penalties into the shared proto; its ranges are checked by request_parsing (common/penalties.py).
    Only what the proto cannot hold is refused here: a logit_bias key that is no integer."""
    p.presence_penalty = body.presence_penalty or 0.0
    p.frequency_penalty = body.frequency_penalty or 0.0
    if body.repetition_penalty is not None:
        p.repetition_penalty = body.repetition_penalty
    p.min_tokens = body.min_tokens or 0
    p.bad_words.extend(body.bad_words or ())
    for key, value in (body.logit_bias or {}).items():
        token = int(key) if re.fullmatch(r"-?[0-9]{1,10}", key.strip()) else None
        if token is None or not -(2**31) <= token < 2**31:
            raise HttpError(
                400, f"logit_bias: the key {key[:40]!r} is not a token id", param="logit_bias", code="invalid_value"
            )
        p.logit_bias[token] = value
