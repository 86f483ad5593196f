"""The sans-IO core of the SDK: everything `Client` (client.py) and `AsyncClient` (aio.py) share, so each of them is
a thin shell that only moves bytes. Here: constructor checks and channel settings (with the service config that
carries balancing, retries and health checking), deadlines, request building, upload planning, the folding of a
stream's responses into deltas and a Result, and the mapping of gRPC errors to the SDK's exceptions. Nothing here
does I/O on the network.

Retries. UNAVAILABLE is retried by gRPC itself, from the channel's service config (`retryPolicy`: at most
`retries` more attempts, exponential backoff with gRPC's jitter); a stream is retried only until the server has
answered (its first response commits the call), so tokens are never repeated. The server's health status for the
generation service is watched by the channel (`healthCheckConfig`): a replica whose worker group is down or that is
draining takes no new calls, and with `wait_for_ready=True` a call waits for one that is serving instead of
failing. What stays here is application logic gRPC cannot know: a replica that misses an uploaded image answers
NOT_FOUND, and the request is sent once more with the images inline.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
import re
import time
import uuid
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Final

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
    from_rpc_error,
)
from mmcast_client.images import SHA_PREFIX, ImageRef, ImageStore
from mmcast_client.messages import Prepared, normalize, prepare, to_proto
from mmcast_client.types import FINISH_REASONS, Backoff, Delta, Result, TokenLogprob, Usage

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
UPLOAD_CHUNK_BYTES = 1 << 20
# The generation service's full name, from the generated code (the file defines this one service).
GENERATION_SERVICE = next(iter(pb.DESCRIPTOR.services_by_name.values())).full_name

DEFAULT_TIMEOUT = 60.0  # seconds: the deadline of a unary call (get_server_info, upload_image) unless timeout= is given
DEFAULT_FIRST_TOKEN_TIMEOUT = 120.0  # seconds: generate() called -> first token (uploads, retries, queueing included)
MAX_RETRIES = 4  # gRPC's retryPolicy allows at most 5 attempts (it silently clamps larger maxAttempts)


class NotGiven(enum.Enum):
    """The default of a per-call setting: use the client's (None there means "no limit", so it cannot be the
    default)."""

    NOT_GIVEN = "NOT_GIVEN"


NOT_GIVEN: Final = NotGiven.NOT_GIVEN


class InsecureTokenWarning(UserWarning):
    """A bearer token is about to travel over a plaintext channel to another host."""


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
    def from_proto(cls, msg: Any) -> ServerInfo:
        return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})


# -- settings --------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChannelSettings:
    """How a client reaches the server; validated once, used by both clients."""

    target: str
    timeout: float | None | NotGiven  # the caller's `timeout=`: every call's deadline, seconds; None: none
    first_token_timeout: float | None  # generate() called -> first token, seconds; None: none
    max_message_bytes: int
    retries: int  # extra attempts gRPC makes after UNAVAILABLE before the server answers, 0..MAX_RETRIES
    backoff: Backoff
    credentials: grpc.ChannelCredentials | None  # None: plaintext
    metadata: tuple[tuple[str, str], ...]  # sent with every call (authorization, ...)
    upload_images: bool  # True: upload each image once, reference by hash; False: bytes inline every time
    user_options: tuple[tuple[str, Any], ...] = ()  # the caller's channel options; they win over the SDK's
    wait_for_ready: bool | None = None  # per call: queue while no replica is ready instead of failing (gRPC's flag)
    interceptors: tuple[Any, ...] = ()  # the caller's client interceptors, applied to the SDK's channel

    @property
    def unary_timeout(self) -> float | None:
        """The deadline of a unary call: the caller's `timeout`, else DEFAULT_TIMEOUT."""
        return DEFAULT_TIMEOUT if self.timeout is NOT_GIVEN else self.timeout

    @property
    def generate_timeout(self) -> float | None:
        """The deadline of a whole generation: the caller's `timeout`, else none (the first token has its own)."""
        return None if self.timeout is NOT_GIVEN else self.timeout

    def service_config(self) -> dict[str, Any]:
        """The SDK's service config: balancing (mmcast_client/affinity.py; left out when the caller's options pick a
        policy), health checking of the generation service, and the retry policy for every method."""
        config: dict[str, Any] = {"healthCheckConfig": {"serviceName": GENERATION_SERVICE}}
        if not affinity.chooses_policy(self.user_options):
            config["loadBalancingConfig"] = affinity.default_balancing()
        if self.retries > 0:
            b = self.backoff
            config["methodConfig"] = [
                {
                    "name": [{}],  # every method of the channel
                    "retryPolicy": {
                        "maxAttempts": self.retries + 1,
                        "initialBackoff": _duration(b.initial),
                        "maxBackoff": _duration(b.maximum),
                        "backoffMultiplier": b.multiplier,
                        "retryableStatusCodes": ["UNAVAILABLE"],
                    },
                }
            ]
        return config

    @property
    def options(self) -> list[tuple[str, Any]]:
        """The channel options: message limits, the retry buffer, the SDK's service config (unless the caller gave
        one), then the caller's options (a key given twice: gRPC keeps the last)."""
        sdk: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            # gRPC keeps a call's request messages to replay them on a retry, 256 KiB by default: a request with
            # images inline, or an upload, would commit at once and never be retried.
            ("grpc.per_rpc_retry_buffer_size", self.max_message_bytes),
        ]
        if not affinity.gives_service_config(self.user_options):
            sdk.append(("grpc.service_config", json.dumps(self.service_config())))
        return sdk + list(self.user_options)

    def call_metadata(self, key: str | None) -> tuple[tuple[str, str], ...]:
        """Metadata for one call of a conversation: the caller's, plus its affinity key unless the caller sent one."""
        if key is None or any(k == affinity.AFFINITY_HEADER for k, _ in self.metadata):
            return self.metadata
        return self.metadata + ((affinity.AFFINITY_HEADER, key),)


def _duration(seconds: float) -> str:
    """A service-config duration ("0.1s"); gRPC needs it > 0."""
    return f"{max(seconds, 0.001):.3f}s"


def _check_timeout(name: str, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise ValueError(f"{name}={value!r} must be > 0 seconds, or None for no limit")


def channel_settings(
    target: str,
    *,
    timeout: float | None | NotGiven,
    first_token_timeout: float | None,
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
    if timeout is not NOT_GIVEN:
        _check_timeout("timeout", timeout)
    _check_timeout("first_token_timeout", first_token_timeout)
    if max_message_bytes < 1 << 16:
        raise ValueError(f"max_message_bytes={max_message_bytes} must be >= 65536")
    if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
        raise ValueError(
            f"retries={retries!r} must be an integer in [0, {MAX_RETRIES}] (gRPC's retryPolicy makes at most 5 "
            "attempts); to ride out a longer outage pass wait_for_ready=True, which waits for a serving replica "
            "until the call's deadline"
        )
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
        first_token_timeout,
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


_SCHEMES = re.compile(r"^(dns|ipv4|ipv6|unix|unix-abstract|vsock|xds|google-c2p)(:|$)")


def target_hosts(target: str) -> list[str] | None:
    """The hosts a gRPC target names; None for a socket that never leaves the machine (unix:, unix-abstract:)."""
    scheme_match = _SCHEMES.match(target)
    scheme = scheme_match.group(1) if scheme_match else "dns"
    if scheme in ("unix", "unix-abstract"):
        return None
    rest = target[scheme_match.end() :] if scheme_match else target
    if scheme == "dns":
        rest = rest[2:].split("/", 1)[-1] if rest.startswith("//") else rest  # dns://authority/host:port
        rest = rest.lstrip("/")
    hosts = []
    for address in rest.split(",") if scheme in ("ipv4", "ipv6") else [rest]:
        address = address.strip()
        if address.startswith("["):
            hosts.append(address[1 : address.find("]")])
        elif address.count(":") > 1:  # a bare IPv6 address without a port
            hosts.append(address)
        else:
            hosts.append(address.rsplit(":", 1)[0] if ":" in address else address)
    return hosts


def is_loopback_target(target: str) -> bool:
    """Whether every address of `target` is this machine (localhost, 127.0.0.0/8, ::1, a unix socket)."""
    hosts = target_hosts(target)
    if hosts is None:
        return True
    for host in hosts:
        if host.lower() == "localhost":
            continue
        try:
            if not ipaddress.ip_address(host).is_loopback:
                return False
        except ValueError:
            return False  # a name: it may resolve anywhere
    return bool(hosts)


def insecure_token_message(settings: ChannelSettings) -> str | None:
    """Why sending this client's credentials is unsafe, or None: a bearer token (`token=` or an `authorization`
    header in `metadata=`) over plaintext to a host other than this machine. Loopback targets are exempt, since
    their traffic never leaves the machine (a local proxy or sidecar terminating TLS is the usual set-up)."""
    if settings.credentials is not None or is_loopback_target(settings.target):
        return None
    if not any(k.lower() == "authorization" for k, _ in settings.metadata):
        return None
    return (
        f"a bearer token is sent to {settings.target} over a plaintext channel: anyone on the network path can read "
        "and reuse it. Pass tls=True (or root_certificates=) to encrypt the channel; loopback targets are exempt"
    )


# -- deadlines -------------------------------------------------------------------------------------------------------
class Deadline:
    """The deadlines of one operation: its whole duration and, for a generation, its first token; each absolute
    (time.monotonic()) or None, measured from `start` (default: now)."""

    def __init__(
        self, timeout: float | None, first_token_timeout: float | None = None, start: float | None = None
    ) -> None:
        start = time.monotonic() if start is None else start
        self.timeout = timeout
        self.first_token_timeout = first_token_timeout
        self.at = None if timeout is None else start + timeout
        self.first_token_at = None if first_token_timeout is None else start + first_token_timeout

    def remaining(self, before_first_token: bool = True) -> float | None:
        """Seconds left (None: unbounded); raises DeadlineExceeded when none are."""
        now = time.monotonic()
        first_token_at = self.first_token_at if before_first_token else None
        if first_token_at is not None and first_token_at <= now:
            raise first_token_deadline_error(self.first_token_timeout)
        if self.at is not None and self.at <= now:
            raise DeadlineExceeded(
                message=f"the deadline of {self.timeout:.3f} s passed; raise timeout= if the server needs longer, "
                "or pass timeout=None"
            )
        left = [t - now for t in (self.at, first_token_at) if t is not None]
        return min(left) if left else None

    def first_token_wait(self) -> float | None:
        """Seconds until the first token is due (None: no such deadline)."""
        return None if self.first_token_at is None else max(0.0, self.first_token_at - time.monotonic())

    def bounded(self, timeout: float | None) -> Deadline:
        """The deadline of one unary call inside this operation (an upload before the first token): `timeout` from
        now, or this operation's deadlines, whichever comes first."""
        inner = Deadline(timeout, None)
        inner.first_token_at, inner.first_token_timeout = self.first_token_at, self.first_token_timeout
        if self.at is not None and (inner.at is None or self.at < inner.at):
            inner.at, inner.timeout = self.at, self.timeout
        return inner


def first_token_deadline_error(first_token_timeout: float | None) -> DeadlineExceeded:
    return DeadlineExceeded(
        message=f"no token arrived within first_token_timeout={first_token_timeout} s (uploads, retries and "
        "queueing included); raise first_token_timeout= (per call or on the client), or pass None for no limit"
    )


# -- the client core -------------------------------------------------------------------------------------------------
class ClientCore:
    """What a client is, without its channel: settings, image bookkeeping, and the building of each call."""

    def __init__(
        self,
        target: str,
        *,
        timeout: float | None | NotGiven,
        first_token_timeout: float | None,
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
        options: Sequence[tuple[str, Any]],
        channel: Any,
        interceptors: Sequence[Any],
        wait_for_ready: bool | None,
        image_store: ImageStore | None,
    ) -> None:
        self.settings = channel_settings(
            target,
            timeout=timeout,
            first_token_timeout=first_token_timeout,
            max_message_bytes=max_message_bytes,
            retries=retries,
            backoff=backoff,
            upload_images=upload_images,
            tls=tls,
            root_certificates=root_certificates,
            private_key=private_key,
            certificate_chain=certificate_chain,
            token=token,
            metadata=metadata,
            options=options,
            wait_for_ready=wait_for_ready,
            interceptors=interceptors,
            channel=channel,
        )
        # stacklevel 3: ClientCore.__init__, the shell's __init__, the caller.
        if channel is not None:
            warnings.warn(affinity.OWN_CHANNEL_WARNING, UserWarning, stacklevel=3)
        else:
            insecure = insecure_token_message(self.settings)
            if insecure is not None:
                warnings.warn(insecure, InsecureTokenWarning, stacklevel=3)
        self.images = image_store if image_store is not None else ImageStore()

    # -- unary calls -------------------------------------------------------------------------------------------------
    def unary_deadline(self, timeout: float | None | NotGiven) -> Deadline:
        return Deadline(self.settings.unary_timeout if timeout is NOT_GIVEN else timeout)

    def server_info_request(self) -> pb.GetServerInfoRequest:
        return pb.GetServerInfoRequest()

    def upload_target(self, ref: ImageRef, force: bool) -> bytes | None:
        """The bytes to upload for `ref` (None: the server holds it per this client's record)."""
        if not force and self.images.is_held(ref.sha256):
            return None
        data = self.images.load(ref)
        if data is None:
            raise NotFound(message=f"sha256:{ref.sha256}: this client has no bytes for it to upload")
        return data

    def uploaded(self, sha: str, response: pb.UploadImageResponse) -> None:
        if response.sha256 != sha:
            raise Internal(message=f"the server stored the upload as sha256:{response.sha256}, expected sha256:{sha}")
        self.images.mark_held(sha)

    @staticmethod
    def reference(ref: ImageRef) -> str:
        return SHA_PREFIX + ref.sha256

    # -- generate ----------------------------------------------------------------------------------------------------
    def prepare_messages(self, messages: str | Sequence[dict], images: Sequence[Any] | None) -> Prepared:
        """Resolves every image (reads files, encodes arrays): the part of generate() that may block."""
        return prepare(normalize(messages, images), self.images)

    def start_generate(
        self,
        prepared: Prepared,
        *,
        started: float,
        max_tokens: int,
        temperature: float,
        top_p: float | None,
        seed: int | None,
        stop: str | Sequence[str] | None,
        stop_token_ids: Sequence[int] | None,
        ignore_eos: bool,
        logprobs: int | None,
        return_logprobs: bool | None,
        request_id: str | None,
        cache_salt: str | None,
        continue_final_message: bool,
        timeout: float | None | NotGiven,
        first_token_timeout: float | None | NotGiven,
        session_id: str | None,
    ) -> GenerateState:
        if timeout is NOT_GIVEN:
            timeout = self.settings.generate_timeout
        else:
            _check_timeout("timeout", timeout)
        if first_token_timeout is NOT_GIVEN:
            first_token_timeout = self.settings.first_token_timeout
        else:
            _check_timeout("first_token_timeout", first_token_timeout)
        request = pb.GenerateRequest(
            request_id=request_id or new_request_id(),
            sampling=sampling_params(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=seed,
                stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=ignore_eos,
                logprobs=resolve_logprobs(logprobs, return_logprobs),
            ),
            cache_salt=cache_salt or "",
            continue_final_message=continue_final_message,
        )
        deadline = Deadline(timeout, first_token_timeout, start=started)
        return GenerateState(self, prepared, request, deadline, started, affinity_key(prepared, session_id))

    def error(self, rpc_error: grpc.RpcError) -> MmcastError:
        return map_rpc_error(rpc_error)


def map_rpc_error(rpc_error: grpc.RpcError) -> MmcastError:
    """The SDK's exception for a failed call, with a hint where gRPC's own message says little."""
    error = from_rpc_error(rpc_error)
    if isinstance(error, Unavailable) and "backend unhealthy" in error.message:
        error.message += (
            f" (the server reports {GENERATION_SERVICE} NOT_SERVING: its worker group is not ready or it is "
            "draining; wait_for_ready=True waits for a serving replica until the call's deadline)"
        )
        error.args = (f"{error.code.name}: {error.message}",)
    return error


class GenerateState:
    """One generate call from first upload to final message: what to send, and what each response or error means.

    The shells drive it: `uploads()` then `request()` before each attempt, `on_response()` for each response,
    `on_error()` when the call fails (it returns to retry with the images inline, or raises), and
    `first_token_overdue()` when the first-token timer fires (True: cancel the call).
    """

    def __init__(
        self,
        core: ClientCore,
        prepared: Prepared,
        request: pb.GenerateRequest,
        deadline: Deadline,
        started: float,
        key: str,
    ) -> None:
        self.core = core
        self.prepared = prepared
        self.request = request
        self.deadline = deadline
        self.key = key  # the x-mmcast-affinity value its calls carry
        self.metadata = core.settings.call_metadata(key)
        self.acc = Accumulator(request.request_id, started)
        self.not_found: NotFound | None = None  # set once a replica missed an uploaded image: retry inline, once
        self.inline: list[pb.ChatMessage] | None = None  # the messages of that retry
        self.first_token_expired = False  # the first-token timer cancelled the call

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def uploads(self) -> list[tuple[str, bytes]]:
        """What to upload before this attempt: (sha, bytes) of the request's images the server lacks per our
        record (none in inline mode, or on the inline retry)."""
        if self.inline is not None or not self.core.settings.upload_images:
            return []
        return upload_plan(self.prepared, self.core.images)

    def upload_deadline(self) -> Deadline:
        return self.deadline.bounded(self.core.settings.unary_timeout)

    def attempt_request(self) -> pb.GenerateRequest:
        """The request of the next attempt, with its messages as the images' state now says."""
        messages = self.inline
        if messages is None:
            messages = request_messages(self.prepared, self.core.images, self.core.settings.upload_images)
        self.request.ClearField("messages")
        self.request.messages.extend(messages)
        return self.request

    def call_timeout(self) -> float | None:
        """The gRPC deadline of the Generate call: the whole generation's (the first-token deadline is a timer)."""
        self.deadline.remaining(before_first_token=not self.acc.tokens_seen)  # raises when one has passed
        return self.deadline.remaining(before_first_token=False)

    def first_token_wait(self) -> float | None:
        """Seconds until the first-token timer should fire; None: no timer."""
        return None if self.acc.tokens_seen else self.deadline.first_token_wait()

    def first_token_overdue(self) -> bool:
        """The timer fired: True (cancel the call) unless a token arrived meanwhile."""
        if self.acc.tokens_seen:
            return False
        self.first_token_expired = True
        return True

    def on_response(self, response: pb.GenerateResponse) -> Delta | Result | None:
        if response.HasField("delta"):
            return self.acc.delta(response.delta)
        if response.HasField("final"):
            return self.acc.final(response.final)
        return None

    def ended_without_final(self) -> MmcastError:
        return self.acc.partial(no_final_error(self.request_id))

    def on_error(self, rpc_error: grpc.RpcError | None) -> None:
        """Returns when the request should be sent again with its images inline; otherwise raises the error (with
        the output received so far). `rpc_error` None: the call was cancelled by the first-token timer."""
        if self.first_token_expired and not self.acc.tokens_seen:
            raise self.acc.partial(first_token_deadline_error(self.deadline.first_token_timeout))
        assert rpc_error is not None
        error = map_rpc_error(rpc_error)
        if self.inline is not None and self.not_found is not None:
            error = inline_retry_error(error, self.not_found)
        if (
            isinstance(error, NotFound)
            and self.not_found is None
            and not self.acc.tokens_seen
            and can_inline(self.prepared, self.core.images)
        ):
            # This replica lacks uploads (another replica holds them, or it evicted them): forget them so the
            # conversation's next turn uploads them again, and retry now with the bytes in the request.
            self.not_found = error
            self.core.images.forget(ref.sha256 for ref in self.prepared.images)
            self.inline = inline_retry_messages(
                self.prepared, self.core.images, error, self.core.settings.max_message_bytes
            )
            return
        raise self.acc.partial(error)


# -- request building ------------------------------------------------------------------------------------------------
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
    seed: int | None,
    stop: str | Sequence[str] | None,
    stop_token_ids: Sequence[int] | None,
    ignore_eos: bool,
    logprobs: int | None,
) -> pb.SamplingParams:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise InvalidArgument(message=f"max_tokens={max_tokens!r} must be an integer >= 1")
    if seed is not None and (not isinstance(seed, int) or not 0 <= seed < 1 << 64):
        raise InvalidArgument(message=f"seed={seed!r} must be an integer in [0, 2**64)")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
        raise InvalidArgument(message=f"logprobs={logprobs!r} must be None, 0 (sampled token only) or a count >= 1")
    params = pb.SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        ignore_eos=ignore_eos,
        logprobs=logprobs or 0,
        return_logprobs=logprobs is not None,
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


def upload_chunks(sha: str, data: bytes) -> Iterator[pb.UploadImageChunk]:
    view = memoryview(data)
    for start in range(0, max(len(data), 1), UPLOAD_CHUNK_BYTES):
        chunk = pb.UploadImageChunk(data=bytes(view[start : start + UPLOAD_CHUNK_BYTES]))
        if start == 0:
            chunk.expected_sha256 = sha
        yield chunk


# -- response folding ------------------------------------------------------------------------------------------------
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
            server_ttft_seconds=msg.timings.time_to_first_token_seconds,
            server_total_seconds=msg.timings.total_seconds,
            queue_seconds=msg.timings.queue_seconds,
            ttft_seconds=(self.first_token_at if self.first_token_at is not None else now) - self.started,
            total_seconds=now - self.started,
        )


def no_final_error(request_id: str) -> MmcastError:
    return Internal(message=f"the stream of request {request_id} ended without a final message")
