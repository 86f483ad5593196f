"""A client's settings, checked once: constants, the channel's options and its service config (balancing,
retries, health checking), and the credentials check (a bearer token over plaintext)."""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import json
import re
from collections.abc import Mapping
from typing import Any, Final

import grpc

from mmcast.v1 import generation_pb2 as pb
from mmcast_client import affinity
from mmcast_client.types import Backoff

DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
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
    """mmcast.v1.GetServerInfoResponse as a plain object (see generation.proto for each field); transfer_mode is
    the enum's short name: "full", "strip" or "lazy"."""

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
    max_video_frames: int = 0  # frames one video may sample; 0: the server serves no video
    max_video_seconds: float = 0.0
    max_video_frame_pixels: int = 0

    @classmethod
    def from_proto(cls, msg: Any) -> ServerInfo:
        fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls) if f.name != "transfer_mode"}
        mode = pb.TransferMode.Name(msg.transfer_mode) if msg.transfer_mode in pb.TransferMode.values() else "unknown"
        return cls(**fields, transfer_mode=mode.removeprefix("TRANSFER_MODE_").lower())


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


def check_timeout(name: str, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value <= 0):
        raise ValueError(f"{name}={value!r} must be > 0 seconds, or None for no limit")


def channel_settings(target: str, channel: Any, options: Mapping[str, Any]) -> ChannelSettings:
    """Checks a client's constructor keywords once. `options`: every key of `ClientOptions` (mmcast_client/_core/
    options.py), defaults filled in."""
    timeout, first_token_timeout = options["timeout"], options["first_token_timeout"]
    max_message_bytes, retries, backoff = options["max_message_bytes"], options["retries"], options["backoff"]
    tls, token = options["tls"], options["token"]
    root_certificates, private_key = options["root_certificates"], options["private_key"]
    certificate_chain = options["certificate_chain"]
    if not target and channel is None:
        raise ValueError("target is empty; pass HOST:PORT of an mmcast scheduler (or several: ipv4:h:p1,h:p2)")
    if channel is not None:
        conflicts = [
            name
            for name, given in (
                ("options", bool(options["options"])),
                ("tls", tls is not None),
                ("root_certificates", root_certificates is not None),
                ("private_key", private_key is not None),
                ("certificate_chain", certificate_chain is not None),
            )
            if given
        ]
        if conflicts:
            raise ValueError(f"channel= is a channel already made; {', '.join(conflicts)} cannot change it")
    channel_options = tuple((str(k), v) for k, v in options["options"])
    if timeout is not NOT_GIVEN:
        check_timeout("timeout", timeout)
    check_timeout("first_token_timeout", first_token_timeout)
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
    md = tuple(options["metadata"])
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
        options["upload_images"],
        channel_options,
        options["wait_for_ready"],
        tuple(options["interceptors"]),
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
