"""The SDK's keyword surface, written once: `ClientOptions` (what `Client(...)` and `AsyncClient(...)` take besides
`target` and `channel`) and `GenerateOptions` (what `generate(...)` takes besides `messages` and `stream`). Both
clients type their `**options` with these (`Unpack`), so a keyword added here reaches both shells, their type
checks and the core at once; the defaults live in the core functions that consume them (`channel_settings`,
`ClientCore.start_generate`), and scripts/check_client_surface.py (`make lint`) fails when the two drift.
"""

from collections.abc import Mapping, Sequence
from typing import Any, Required, TypedDict

from mmcast_client._core.client_settings import (
    DEFAULT_FIRST_TOKEN_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    NOT_GIVEN,
    NotGiven,
)
from mmcast_client.images import ImageStore
from mmcast_client.types import Backoff


class ClientOptions(TypedDict, total=False):
    """Constructor keywords of both clients (meanings: `Client`'s docstring, mmcast_client/client.py)."""

    timeout: float | None | NotGiven  # every call's deadline, seconds; None: none; not given: DEFAULT_TIMEOUT (unary)
    first_token_timeout: float | None  # generate() called -> first token, seconds; None: none
    max_message_bytes: int  # the channel's send and receive limit, >= 65536
    retries: int  # gRPC's extra attempts after UNAVAILABLE before the server answers, 0..MAX_RETRIES
    backoff: Backoff | float  # the retries' backoff; a float is its initial delay in seconds
    upload_images: bool  # True: upload each image once and reference it by hash; False: bytes inline every time
    tls: bool | None  # None: TLS iff any certificate argument is given
    root_certificates: bytes | None
    private_key: bytes | None
    certificate_chain: bytes | None
    token: str | None  # sent as `authorization: Bearer ...`
    metadata: Sequence[tuple[str, str]]  # sent with every call
    options: Sequence[tuple[str, Any]]  # extra gRPC channel options; they win over the SDK's
    interceptors: Sequence[Any]  # client interceptors of the shell's kind (grpc or grpc.aio)
    wait_for_ready: bool | None  # gRPC's per-call flag: queue while no replica is serving
    image_store: ImageStore | None  # the bounded record of images the server holds (mmcast_client/images.py)


class GenerateOptions(TypedDict, total=False):
    """Keywords of `generate` on both clients (meanings: `Client.generate`'s docstring); max_tokens is required."""

    max_tokens: Required[int]  # tokens to generate at most, >= 1
    images: Sequence[Any] | None  # shown before the prompt when `messages` is a string
    temperature: float  # 0: greedy
    top_p: float | None
    top_k: int | None
    seed: int | None
    stop: str | Sequence[str] | None
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool
    presence_penalty: float  # [-2, 2], once per distinct output token (0: none)
    frequency_penalty: float  # [-2, 2], per occurrence in the output (0: none)
    repetition_penalty: float | None  # (0, 1000] over prompt and output tokens (None or 1: none)
    logit_bias: Mapping[int, float] | None  # token id -> bias in [-100, 100] added to its logit
    min_tokens: int  # tokens before end-of-sequence or a stop token may be drawn, <= max_tokens
    bad_words: Sequence[str] | None  # words never generated (vLLM's rule)
    logprobs: int | None  # None: none; 0: the sampled tokens'; k: also the k most likely alternatives
    return_logprobs: bool | None  # deprecated spelling of logprobs=0
    request_id: str | None  # default: a fresh random id
    cache_salt: str | None
    continue_final_message: bool
    timeout: float | None | NotGiven  # the whole generation's deadline; not given: the client's
    first_token_timeout: float | None | NotGiven  # not given: the client's
    session_id: str | None  # the conversation's name for replica affinity
    live: bool | Mapping[str, Any] | None  # a live session's turn: True, or {"keep_turns": k, "close": bool}
    # structured output: {"json_schema": dict or JSON text} | {"json_object": True} | {"regex": str} | {"choice": [...]}
    structured_output: Mapping[str, Any] | None


def check_keywords(call: str, given: Mapping[str, Any], allowed: type) -> None:
    """Raises the TypeError Python raises for a misspelt keyword, naming the call the user made."""
    for name in given:
        if name not in allowed.__annotations__:
            raise TypeError(f"{call}() got an unexpected keyword argument {name!r}")
    missing = sorted(getattr(allowed, "__required_keys__", frozenset()) - given.keys())
    if missing:
        raise TypeError(f"{call}() missing required keyword-only argument: {missing[0]!r}")


# The defaults, one per optional keyword above (scripts/check_client_surface.py checks the keys match). NOT_GIVEN
# for a per-call deadline: use the client's (None there means "no limit", so it cannot be the default).
CLIENT_DEFAULTS: dict[str, Any] = {
    "timeout": NOT_GIVEN,
    "first_token_timeout": DEFAULT_FIRST_TOKEN_TIMEOUT,
    "max_message_bytes": DEFAULT_MAX_MESSAGE_BYTES,
    "retries": 3,
    "backoff": Backoff(),
    "upload_images": True,
    "tls": None,
    "root_certificates": None,
    "private_key": None,
    "certificate_chain": None,
    "token": None,
    "metadata": (),
    "options": (),
    "interceptors": (),
    "wait_for_ready": None,
    "image_store": None,
}
GENERATE_DEFAULTS: dict[str, Any] = {
    "images": None,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": None,
    "seed": None,
    "stop": None,
    "stop_token_ids": None,
    "ignore_eos": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": None,
    "logit_bias": None,
    "min_tokens": 0,
    "bad_words": None,
    "logprobs": None,
    "return_logprobs": None,
    "request_id": None,
    "cache_salt": None,
    "continue_final_message": False,
    "timeout": NOT_GIVEN,
    "first_token_timeout": NOT_GIVEN,
    "session_id": None,
    "live": None,
    "structured_output": None,
}


def with_defaults(call: str, given: Mapping[str, Any], allowed: type, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The keywords of one call, checked against its options type, with every default filled in."""
    check_keywords(call, given, allowed)
    return {**defaults, **given}
