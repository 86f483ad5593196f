"""Requests from the caller's arguments: sampling parameters, the messages of each attempt (images by hash or
inline), the uploads they need, affinity keys, and the inline retry after a replica missed an upload."""

from __future__ import annotations

import re
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence

from mmcast.v1 import generation_pb2 as pb
from mmcast_client import affinity
from mmcast_client.errors import InvalidArgument, MmcastError, NotFound, ResourceExhausted
from mmcast_client.images import ImageRef, ImageStore
from mmcast_client.messages import Prepared, VideoPart, to_proto

UPLOAD_CHUNK_BYTES = 1 << 20  # an upload travels in chunks of this size


def resolve_logprobs(logprobs: int | None, return_logprobs: bool | None) -> int | None:
    """One `logprobs` from the current parameter and the deprecated `return_logprobs` (vLLM's convention: None no
    log-probabilities, 0 the sampled token's, k also the k most likely alternatives)."""
    if return_logprobs is None:
        return logprobs
    warnings.warn(
        "return_logprobs= is deprecated: pass logprobs=0 for the sampled tokens' log-probabilities, logprobs=k for "
        "the top k alternatives too, or logprobs=None (the default) for none",
        DeprecationWarning,
        stacklevel=4,  # resolve_logprobs, start_generate, the shell's generate, the caller
    )
    if return_logprobs or (logprobs or 0) > 0:
        return logprobs or 0
    return None


def sampling_params(
    *,
    max_tokens: int,
    temperature: float,
    top_p: float | None,
    top_k: int | None,
    seed: int | None,
    stop: str | Sequence[str] | None,
    stop_token_ids: Sequence[int] | None,
    ignore_eos: bool,
    logprobs: int | None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float | None = None,
    logit_bias: Mapping[int, float] | None = None,
    min_tokens: int = 0,
    bad_words: Sequence[str] | None = None,
) -> pb.SamplingParams:
    """The request's sampling; only what the proto cannot carry is refused here (the server checks the ranges)."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgument(message=f"max_tokens={max_tokens!r} must be an integer >= 1")
    if seed is not None and (not isinstance(seed, int) or not 0 <= seed < 1 << 64):
        raise InvalidArgument(message=f"seed={seed!r} must be an integer in [0, 2**64)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k < 1 << 32):
        raise InvalidArgument(message=f"top_k={top_k!r} must be None, 0 (no top-k cut) or a count in [1, 2**32)")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise InvalidArgument(message=f"logprobs={logprobs!r} must be None, 0 (sampled token only) or a count >= 1")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or not 0 <= min_tokens < 1 << 32:
        raise InvalidArgument(message=f"min_tokens={min_tokens!r} must be an integer >= 0")
    for token in logit_bias or {}:
        if isinstance(token, bool) or not isinstance(token, int) or not -(1 << 31) <= token < 1 << 31:
            raise InvalidArgument(message=f"logit_bias: the key {token!r} is not a token id (an int)")
    params = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        ignore_eos=ignore_eos,
        logprobs=logprobs or 0,
        return_logprobs=logprobs is not None,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        logit_bias=dict(logit_bias or {}),
        min_tokens=min_tokens,
        bad_words=[bad_words] if isinstance(bad_words, str) else list(bad_words or ()),
    )
    if repetition_penalty is not None:
        params.repetition_penalty = repetition_penalty
    if top_p is not None:
        params.top_p = top_p
    if top_k:  # None and 0 both mean no cut: the proto's unset 0
        params.top_k = top_k
    if seed is not None:
        params.seed = seed
    if stop:
        params.stop.extend([stop] if isinstance(stop, str) else stop)
    if stop_token_ids:
        params.stop_token_ids.extend(stop_token_ids)
    return params


def new_request_id() -> str:
    return uuid.uuid4().hex


def upload_plan(prepared: Prepared, store: ImageStore) -> list[tuple[str, bytes]]:
    """(sha, bytes) of the request's images the server does not hold per our record and whose bytes we have."""
    plan = []
    for ref in prepared.images:
        if store.is_held(ref.sha256):
            continue
        data = store.load(ref)
        if data is not None:
            plan.append((ref.sha256, data))
    return plan


def request_messages(prepared: Prepared, store: ImageStore, upload_images: bool) -> list[pb.ChatMessage]:
    """Upload mode: every image by hash (uploaded ones, and bare references we have no bytes for). Inline mode:
    bytes for every image we can load, bare references otherwise."""
    if upload_images:
        return to_proto(prepared, by_hash=lambda ref: True, load=store.load)
    loadable: dict[str, bool] = {}

    def by_hash(ref: ImageRef) -> bool:
        if ref.sha256 not in loadable:
            loadable[ref.sha256] = store.load(ref) is not None
        return not loadable[ref.sha256]

    return to_proto(prepared, by_hash=by_hash, load=store.load)


def can_inline(prepared: Prepared, store: ImageStore) -> bool:
    """On NOT_FOUND: whether sending images inline could help (some referenced image has bytes we could send)."""
    return any(store.load(ref) is not None for ref in prepared.images)


def affinity_key(prepared: Prepared, session_id: str | None) -> str:
    """The conversation's affinity key (mmcast_client/affinity.py): `session_id` when given, else a hash of the
    first user message (the first message when none is from the user)."""
    if session_id is not None:
        return _session_key(session_id)
    first = next((parts for role, parts in prepared.messages if role == pb.ROLE_USER), prepared.messages[0][1])
    return affinity.conversation_key([_affinity_part(p) for p in first])


def _affinity_part(part) -> str | tuple[str, str]:
    if isinstance(part, str):
        return part
    if isinstance(part, VideoPart):
        return ("video", part.ref.sha256)
    return ("image", part.sha256)


def upload_key(ref: ImageRef, session_id: str | None) -> str:
    """The affinity key of a standalone upload: the session's, else that of a first message holding just the image."""
    if session_id is not None:
        return _session_key(session_id)
    return affinity.conversation_key([("image", ref.sha256)])


def _session_key(session_id: str) -> str:
    try:
        return affinity.session_key(session_id)
    except ValueError as e:
        raise InvalidArgument(message=str(e)) from None


_SHA_IN_MESSAGE = re.compile(r"\b[0-9a-f]{64}\b")


def inline_retry_messages(
    prepared: Prepared, store: ImageStore, not_found: NotFound, max_message_bytes: int
) -> list[pb.ChatMessage]:
    """The messages of the one retry after a replica missed an uploaded image: every image we hold bytes for goes
    inline (the server names only the first hash it missed, and an upload RPC could land on another replica).
    Raises ResourceExhausted, naming the limit, when they would not fit in one request."""
    messages = request_messages(prepared, store, upload_images=False)
    size = sum(m.ByteSize() for m in messages)
    if size > max_message_bytes:
        missed = (
            not_found.resource_info.resource_name
            if not_found.resource_info is not None
            else (m.group(0) if (m := _SHA_IN_MESSAGE.search(not_found.message)) else "?")
        )
        raise ResourceExhausted(
            message=f"the replica that served this request lacks image sha256:{missed} "
            f"({not_found.message}); sending the request's images inline takes {size} bytes, over this client's "
            f"max_message_bytes={max_message_bytes}. Raise max_message_bytes= (and the servers' --max-request-bytes), "
            "or keep the conversation on one replica (the default ring-hash balancing, session_id=)"
        )
    return messages


def inline_retry_error(error: MmcastError, not_found: NotFound) -> MmcastError:
    """A server's refusal of the inline retry as too large, said with why the images were inline."""
    if not isinstance(error, ResourceExhausted):
        return error
    explained = ResourceExhausted(
        message=f"the replica that served this request lacked an uploaded image ({not_found.message}), and the retry "
        f"with the images inline was refused: {error.message}. Raise the servers' --max-request-bytes, or keep the "
        "conversation on one replica (the default ring-hash balancing, session_id=)"
    )
    explained.field_violations, explained.retry_delay = error.field_violations, error.retry_delay
    explained.resource_info = error.resource_info
    return explained


def upload_chunks(sha: str, data: bytes) -> Iterator[pb.UploadImageRequest]:
    view = memoryview(data)
    for start in range(0, max(len(data), 1), UPLOAD_CHUNK_BYTES):
        chunk = pb.UploadImageRequest(data=bytes(view[start : start + UPLOAD_CHUNK_BYTES]))
        if start == 0:
            chunk.expected_sha256 = sha
        yield chunk


def arrived_altered(error: MmcastError) -> bool:
    """The server received other bytes than this client sent: their sha256 is not the ``expected_sha256`` the client
    computed from its own bytes (the server names that field). A client stream that gRPC replays after a retryable
    failure has arrived altered this way under load; the upload is sent once more, from the start."""
    return isinstance(error, InvalidArgument) and any(v.field == "expected_sha256" for v in error.field_violations)


def structured_output(spec) -> pb.StructuredOutput:
    """`structured_output=` as the proto: exactly one of json_schema (a dict or JSON text), json_object, regex,
    choice (a list of strings)."""
    import json

    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError("structured_output= takes one of json_schema, json_object, regex, choice")
    ((kind, value),) = spec.items()
    if kind == "json_schema":
        return pb.StructuredOutput(json_schema=value if isinstance(value, str) else json.dumps(value))
    if kind == "json_object":
        return pb.StructuredOutput(json_object=bool(value))
    if kind == "regex":
        return pb.StructuredOutput(regex=str(value))
    if kind == "choice":
        return pb.StructuredOutput(choice=pb.ChoiceList(choices=[str(c) for c in value]))
    raise ValueError(f"structured_output= takes json_schema, json_object, regex or choice, not {kind!r}")


def live_session(live, session_id: str | None) -> pb.LiveSession:
    """`live=True` or `{"keep_turns": k, "close": bool}` for the session named by `session_id`."""
    if session_id is None:
        raise ValueError("live= needs session_id=: the live session's name")
    options = {} if live is True else dict(live)
    unknown = sorted(set(options) - {"keep_turns", "close"})
    if unknown:
        raise ValueError(f"live= takes keep_turns and close, not {unknown[0]!r}")
    return pb.LiveSession(
        session_id=session_id, keep_turns=int(options.get("keep_turns") or 0), close=bool(options.get("close"))
    )
