"""Conversation affinity: which replica serves a conversation, chosen by gRPC's own `ring_hash` balancer.

Each replica (one scheduler and its worker group) keeps its own prefix cache and upload store, so a conversation
is cheap only where its earlier turns ran. The SDK names a conversation with an *affinity key* and sends it as
the request header `x-mmcast-affinity` (documented in proto/mmcast/v1/generation.proto) on every call of that
conversation: its uploads and its generates. The channel's default service config hashes that header onto a ring
of the target's addresses (`ipv4:h:p1,h:p2`, `dns:///headless-svc:50051`, ...), so every turn lands on one replica;
when that replica is unreachable the ring's next one serves it (one cache miss), and when it returns, the ring
gives its conversations back. A target with one address behaves as before.

The key of a conversation is, by default, a hash of its first user message (text as sent, images by the sha256 of
their bytes), which every later turn repeats; `session_id=` overrides it. Ring hashing has no load bound: many
conversations that open with the same message share one replica, so give those a `session_id`.

gRPC (1.85) accepts `requestHashHeader` only while GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY is true when
it parses a channel's service config; without it the policy ignores the header and fails every call ("hash
attribute not present"). The SDK sets the variable unless the process set it already; set to false, the SDK warns
and balances round-robin instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Sequence

AFFINITY_HEADER = "x-mmcast-affinity"
RING_HASH_ENV = "GRPC_EXPERIMENTAL_RING_HASH_SET_REQUEST_HASH_KEY"
# Channel options that choose a balancing policy: given any of them, the user's choice stands and the SDK adds none.
_POLICY_OPTIONS = ("grpc.service_config", "grpc.lb_policy_name")
_FALSE = ("0", "false", "no", "off")

RING_HASH_BALANCING: list[dict] = [{"ring_hash_experimental": {"requestHashHeader": AFFINITY_HEADER}}]
ROUND_ROBIN_BALANCING: list[dict] = [{"round_robin": {}}]
# The balancing alone, for a caller's own channel (the SDK's channel adds its retry policy: mmcast_client/_core/).
RING_HASH_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": RING_HASH_BALANCING})
ROUND_ROBIN_SERVICE_CONFIG = json.dumps({"loadBalancingConfig": ROUND_ROBIN_BALANCING})
# What a client built on a caller's channel says: that channel's balancing, not the SDK's, decides where calls go.
OWN_CHANNEL_WARNING = (
    "channel=: the SDK uses this channel as is, so its balancing is yours; for conversation affinity over several "
    f"replicas give it a ring_hash service config on the {AFFINITY_HEADER} header "
    "(mmcast_client.affinity.RING_HASH_SERVICE_CONFIG)"
)


def conversation_key(first_user_message: Sequence[str | tuple[str, str]]) -> str:
    """The key of a conversation from its first user message: parts in order, a text as `str`, an image as
    `("image", sha256 hex)`. 32 hex digits; equal messages give equal keys."""
    h = hashlib.sha256(b"mmcast-affinity-v1")
    for part in first_user_message:
        if isinstance(part, str):
            data = part.encode()
            h.update(b"t" + len(data).to_bytes(8, "little") + data)
        else:
            h.update(b"i" + part[1].encode())
    return h.hexdigest()[:32]


def session_key(session_id: str) -> str:
    """The key of an explicit session id (hashed, so the header never carries the caller's string)."""
    if not isinstance(session_id, str) or not session_id:
        raise ValueError(f"session_id={session_id!r} must be a non-empty string")
    return hashlib.sha256(b"mmcast-session-v1\0" + session_id.encode()).hexdigest()[:32]


def ring_hash_enabled() -> bool:
    """Sets the variable gRPC needs for `requestHashHeader` unless the process chose a value; True when on."""
    value = os.environ.setdefault(RING_HASH_ENV, "true")
    return value.strip().lower() not in _FALSE


def default_balancing() -> list[dict]:
    """The `loadBalancingConfig` of the SDK's service config: ring hash on the affinity header, or round robin (with
    a warning) when the process turned the header off."""
    if ring_hash_enabled():
        return RING_HASH_BALANCING
    warnings.warn(
        f"{RING_HASH_ENV}={os.environ.get(RING_HASH_ENV)!r}: gRPC would ignore the {AFFINITY_HEADER} header, so the "
        "SDK balances round-robin and conversations lose their prefix cache across replicas; unset it or set it to "
        "true before creating the client",
        RuntimeWarning,
        stacklevel=5,
    )
    return ROUND_ROBIN_BALANCING


def chooses_policy(options: Sequence[tuple[str, object]]) -> bool:
    """Whether the caller's channel options pick a balancing policy themselves."""
    return any(key in _POLICY_OPTIONS for key, _ in options)


def gives_service_config(options: Sequence[tuple[str, object]]) -> bool:
    """Whether the caller's channel options carry a whole service config (which then replaces the SDK's)."""
    return any(key == "grpc.service_config" for key, _ in options)


# Set it when the SDK is imported too: a process that creates its own channels later sees the same setting.
os.environ.setdefault(RING_HASH_ENV, "true")
