"""What the sync and asyncio clients share: channel set-up, request building, upload planning, result assembly and
the retry rules. Nothing here does I/O on the network."""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import grpc

from mmcast.v1 import generation_pb2 as pb
from mmcast_client import affinity
from mmcast_client.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    MmcastError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_google_rpc_code,
)
from mmcast_client.images import ImageRef, ImageStore
from mmcast_client.messages import Prepared, to_proto
from mmcast_client.types import FINISH_REASONS, Backoff, Delta, Result, TokenLogprob, Usage, seconds

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
UPLOAD_CHUNK_BYTES = 1 << 20
GENERATION_SERVICE = "mmcast.v1.GenerationService"


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """mmcast.v1.ServerInfo as a plain object (see generation.proto for each field)."""

    model: str
    model_fingerprint: str
    max_model_len: int
    max_images_per_request: int
    max_image_pixels: int
    max_request_bytes: int
    max_upload_bytes: int
    transfer_mode: str
    tensor_parallel_size: int
    group_ready: bool

    @classmethod
    def from_proto(cls, msg: pb.GetServerInfoResponse) -> ServerInfo:
        fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name != "transfer_mode"}
        mode = pb.TransferMode.Name(msg.transfer_mode) if msg.transfer_mode in pb.TransferMode.values() else "unknown"
        return cls(**fields, transfer_mode=mode.removeprefix("TRANSFER_MODE_").lower())


@dataclasses.dataclass(frozen=True)
class ChannelSettings:
    """How a client reaches the server; validated once, used by both clients."""

    target: str
    timeout: float | None  # default deadline of one call (retries included), seconds; None: no deadline
    max_message_bytes: int
    retries: int  # extra attempts after UNAVAILABLE before the first token
    backoff: Backoff
    credentials: grpc.ChannelCredentials | None  # None: plaintext
    metadata: tuple[tuple[str, str], ...]  # sent with every call (authorization, ...)
    upload_images: bool  # True: upload each image once, reference by hash; False: bytes inline every time
    user_options: tuple[tuple[str, Any], ...] = ()  # the caller's channel options; they win over the SDK's
    wait_for_ready: bool | None = None  # per call: queue while no replica is ready instead of failing (gRPC's flag)
    interceptors: tuple[Any, ...] = ()  # the caller's client interceptors, applied to the SDK's channel

    @property
    def options(self) -> list[tuple[str, Any]]:
        """The channel options: message limits, the affinity service config (unless the caller picked a policy),
        then the caller's options (a key given twice: gRPC keeps the last)."""
        sdk: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
        ]
        if not affinity.chooses_policy(self.user_options):
            sdk.append(("grpc.service_config", affinity.default_service_config()))
        return sdk + list(self.user_options)

    def call_metadata(self, key: str | None) -> tuple[tuple[str, str], ...]:
        """Metadata for one call of a conversation: the caller's, plus its affinity key unless the caller sent one."""
        if key is None or any(k == affinity.AFFINITY_HEADER for k, _ in self.metadata):
            return self.metadata
        return self.metadata + ((affinity.AFFINITY_HEADER, key),)


def channel_settings(
    target: str,
    *,
    timeout: float | None,
    max_message_bytes: int,
    retries: int,
    backoff: Backoff | float,
    upload_images: bool,
    tls: bool | None,
    root_certificates: bytes | None,
    private_key: bytes | None,
    certificate_chain: bytes | None,
    token: str | None,
    metadata: Sequence[tuple[str, str]],
    options: Sequence[tuple[str, Any]] = (),
    wait_for_ready: bool | None = None,
    interceptors: Sequence[Any] = (),
    channel: Any = None,
) -> ChannelSettings:
    if not target and channel is None:
        raise ValueError("target is empty; pass HOST:PORT of an mmcast scheduler (or several: ipv4:h:p1,h:p2)")
    if channel is not None:
        conflicts = [
            name
            for name, given in (
                ("options", bool(options)),
                ("tls", tls is not None),
                ("root_certificates", root_certificates is not None),
                ("private_key", private_key is not None),
                ("certificate_chain", certificate_chain is not None),
            )
            if given
        ]
        if conflicts:
            raise ValueError(f"channel= is a channel already made; {', '.join(conflicts)} cannot change it")
    options = tuple((str(k), v) for k, v in options)
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds or None")
    if max_message_bytes < 1 << 16:
        raise ValueError(f"max_message_bytes={max_message_bytes} must be >= 65536")
    if retries < 0:
        raise ValueError(f"retries={retries} must be >= 0")
    if not isinstance(backoff, Backoff):
        backoff = Backoff(initial=float(backoff))
    secure = tls if tls is not None else any(x is not None for x in (root_certificates, private_key, certificate_chain))
    credentials = None
    if secure:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=root_certificates, private_key=private_key, certificate_chain=certificate_chain
        )
    md = tuple(metadata)
    if token:
        md += (("authorization", f"Bearer {token}"),)
    return ChannelSettings(
        target,
        timeout,
        max_message_bytes,
        retries,
        backoff,
        credentials,
        md,
        upload_images,
        options,
        wait_for_ready,
        tuple(interceptors),
    )


class Deadline:
    """An absolute deadline for one operation, retries and uploads included."""

    def __init__(self, timeout: float | None) -> None:
        self.at = None if timeout is None else time.monotonic() + timeout
        self.timeout = timeout

    def remaining(self) -> float | None:
        """Seconds left (None: unbounded); raises DeadlineExceeded when none are."""
        if self.at is None:
            return None
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(
                message=f"the deadline of {self.timeout:.3f} s passed; raise timeout= if the server needs longer"
            )
        return left

    def allows_wait(self, seconds: float) -> bool:
        return self.at is None or time.monotonic() + seconds < self.at


def sampling_params(
    *,
    max_tokens: int,
    temperature: float,
    top_p: float | None,
    seed: int | None,
    stop: str | Sequence[str] | None,
    stop_token_ids: Sequence[int] | None,
    ignore_eos: bool,
    logprobs: int,
    return_logprobs: bool,
) -> pb.SamplingParams:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgument(message=f"max_tokens={max_tokens!r} must be an integer >= 1")
    if seed is not None and (not isinstance(seed, int) or not 0 <= seed < 1 << 64):
        raise InvalidArgument(message=f"seed={seed!r} must be an integer in [0, 2**64)")
    params = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        return_logprobs=return_logprobs or logprobs > 0,
    )
    if top_p is not None:
        params.top_p = top_p
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
    return affinity.conversation_key([p if isinstance(p, str) else ("image", p.sha256) for p in first])


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
        missed = _SHA_IN_MESSAGE.search(not_found.message)
        raise ResourceExhausted(
            message=f"the replica that served this request lacks image sha256:{missed.group(0) if missed else '?'} "
            f"({not_found.message}); sending the request's images inline takes {size} bytes, over this client's "
            f"max_message_bytes={max_message_bytes}. Raise max_message_bytes= (and the servers' --max-request-bytes), "
            "or keep the conversation on one replica (the default ring-hash balancing, session_id=)"
        )
    return messages


def inline_retry_error(error: MmcastError, not_found: NotFound) -> MmcastError:
    """A server's refusal of the inline retry as too large, said with why the images were inline."""
    if not isinstance(error, ResourceExhausted):
        return error
    return ResourceExhausted(
        message=f"the replica that served this request lacked an uploaded image ({not_found.message}), and the retry "
        f"with the images inline was refused: {error.message}. Raise the servers' --max-request-bytes, or keep the "
        "conversation on one replica (the default ring-hash balancing, session_id=)"
    )


def upload_chunks(sha: str, data: bytes) -> Iterator[pb.UploadImageRequest]:
    view = memoryview(data)
    for start in range(0, max(len(data), 1), UPLOAD_CHUNK_BYTES):
        chunk = pb.UploadImageRequest(data=bytes(view[start : start + UPLOAD_CHUNK_BYTES]))
        if start == 0:
            chunk.expected_sha256 = sha
        yield chunk


def check_upload(sha: str, response: pb.UploadImageResponse) -> None:
    if response.sha256 != sha:
        raise Internal(message=f"the server stored the upload as sha256:{response.sha256}, expected sha256:{sha}")


class RetryState:
    """The rules of one generate call: which errors before the first token are retried, and how."""

    def __init__(self, settings: ChannelSettings, deadline: Deadline) -> None:
        self.settings = settings
        self.deadline = deadline
        self.attempt = 0  # UNAVAILABLE retries so far
        self.not_found: NotFound | None = None  # set once a replica missed an uploaded image: retry inline, once

    def on_error(self, error: MmcastError, tokens_seen: bool, inlinable) -> str | float:
        """'inline' (retry with the images inline), a delay in seconds before a retry, or 'raise'."""
        if tokens_seen:
            return "raise"  # the stream has produced output; a retry would repeat it
        if isinstance(error, NotFound) and self.not_found is None and inlinable():
            self.not_found = error
            return "inline"
        if isinstance(error, Unavailable) and self.attempt < self.settings.retries:
            delay = self.settings.backoff.delay(self.attempt)
            if not self.deadline.allows_wait(delay):
                return "raise"
            self.attempt += 1
            return delay
        return "raise"


class Accumulator:
    """Collects one stream's deltas into a Result; times are measured from `started` (time.monotonic())."""

    def __init__(self, request_id: str, started: float) -> None:
        self.request_id = request_id
        self.started = started
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.first_token_at: float | None = None

    @property
    def tokens_seen(self) -> bool:
        return self.first_token_at is not None

    def delta(self, msg: pb.TokenDelta) -> Delta:
        if msg.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        ids = tuple(msg.token_ids)
        lps = tuple(TokenLogprob.from_proto(lp) for lp in msg.logprobs)
        self.token_ids.extend(ids)
        self.text.append(msg.text)
        self.logprobs.extend(lps)
        return Delta(ids, msg.text, lps)

    def partial(self, error: MmcastError) -> MmcastError:
        """`error` carrying the output received so far (a stream that failed after its first token)."""
        error.token_ids = tuple(self.token_ids)
        error.text = "".join(self.text)
        error.logprobs = tuple(self.logprobs)
        if self.token_ids:
            error.message += f" (after {len(self.token_ids)} tokens; they are on this error's token_ids and text)"
            error.args = (f"{error.code.name}: {error.message}",)
        return error

    def final(self, msg: pb.GenerateFinal) -> Result:
        """The Result, or the typed exception of a final message with FINISH_REASON_ERROR."""
        if msg.finish_reason == pb.FINISH_REASON_ERROR:
            raise from_google_rpc_code(msg.error.grpc_code, msg.error.message or "generation failed on the server")
        now = time.monotonic()
        return Result(
            request_id=msg.request_id or self.request_id,
            token_ids=tuple(self.token_ids),
            text="".join(self.text),
            logprobs=tuple(self.logprobs),
            finish_reason=FINISH_REASONS.get(msg.finish_reason, "unspecified"),
            usage=Usage.from_proto(msg.usage),
            stop_reason=msg.stop_reason,
            server_ttft_seconds=seconds(msg.timings.time_to_first_token),
            server_total_seconds=seconds(msg.timings.total_time),
            queue_seconds=seconds(msg.timings.queue_time),
            ttft_seconds=(self.first_token_at if self.first_token_at is not None else now) - self.started,
            total_seconds=now - self.started,
        )


def no_final_error(request_id: str) -> MmcastError:
    return Internal(message=f"the stream of request {request_id} ended without a final message")
