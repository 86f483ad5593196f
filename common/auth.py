"""Bearer tokens: who may call a service, and as which tenant.

A ``TokenTable`` maps tokens to tenant names. It is read from a file (Kubernetes mounts Secrets as files) in one
of two forms:

- text: one ``<tenant> <token>`` pair a line; blank lines and lines starting with ``#`` are ignored;
- JSON: an object ``{"<token>": "<tenant>", ...}``.

A tenant may have several tokens (rotation: add the new one, roll the clients, remove the old one). The file is
re-read when it changes (checked at most every ``reload_seconds``); a file that no longer parses keeps the last
good table and logs why. Tokens are held only as sha256 digests; a presented token's digest is compared with every
known digest in constant time (``hmac.compare_digest``, no early exit), so a lookup's timing says nothing about
how much of a guessed token was right, nor which entry matched.

``BearerTokenInterceptor`` guards the methods under given prefixes (``/mmcast.v1.GenerationService/``): a call without
``authorization: Bearer <token>`` metadata naming a known token ends with UNAUTHENTICATED before the servicer
runs or the request is even parsed. Every other method (``grpc.health.v1``, server reflection) stays open, so
probes and tooling work without secrets.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import grpc

log = logging.getLogger(__name__)

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # no '/' or ':': scoped ids use them as separators
TOKEN_TEXT = re.compile(r"[\x21-\x7e]+")  # printable ASCII without spaces: what gRPC metadata can carry
MIN_TOKEN_CHARS = 16
AUTHORIZATION = "authorization"


class TokenFileError(ValueError):
    """A token file that cannot be used; the message names the file, the line and what is wrong."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def _check_token(token: str, where: str) -> None:
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenFileError(f"{where}: a token has {len(token)} characters; at least {MIN_TOKEN_CHARS} are required")
    if not TOKEN_TEXT.fullmatch(token):
        raise TokenFileError(f"{where}: a token may contain only printable ASCII characters without spaces")


def parse_tokens(text: str, source: str = "tokens") -> dict[bytes, str]:
    """Token file contents -> {sha256(token): tenant}. Raises ``TokenFileError`` naming the line."""
    pairs: list[tuple[str, str, str]] = []  # (token, tenant, where)
    if text.lstrip().startswith("{"):
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TokenFileError(f"{source}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        for token, tenant in doc.items():
            if not isinstance(tenant, str):
                raise TokenFileError(f"{source}: the value of every token must be a tenant name (a string)")
            pairs.append((token, tenant, f"{source}: tenant {tenant!r}"))
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) != 2:
                raise TokenFileError(f"{source}:{lineno}: expected '<tenant> <token>', got {len(words)} fields")
            pairs.append((words[1], words[0], f"{source}:{lineno}"))
    table: dict[bytes, str] = {}
    for token, tenant, where in pairs:
        if not TENANT_NAME.fullmatch(tenant):
            raise TokenFileError(
                f"{where}: tenant name {tenant[:80]!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
                "letter or digit"
            )
        _check_token(token, where)
        digest = _digest(token)
        if table.get(digest, tenant) != tenant:
            raise TokenFileError(f"{where}: the same token is listed for tenants {table[digest]!r} and {tenant!r}")
        table[digest] = tenant
    if not table:
        raise TokenFileError(f"{source}: no tokens; every call would be refused")
    return table


def read_token_file(path: str, flag: str) -> str:
    """A file holding one shared token (surrounding whitespace ignored). Raises ``TokenFileError``."""
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"{flag}={path}: cannot read the token ({exc})") from None
    _check_token(token, f"{flag}={path}")
    return token


class TokenTable:
    """Token -> tenant, from a file that may change under a running process."""

    def __init__(self, path: str, *, flag: str = "--auth-tokens-file", reload_seconds: float = 5.0) -> None:
        self.path = path
        self.flag = flag
        self.reload_seconds = reload_seconds
        self._lock = threading.Lock()
        self._stamp = self._file_stamp()
        self._table = self._load()
        self._checked = time.monotonic()

    @classmethod
    def single(cls, token: str, tenant: str) -> TokenTable:
        """A table of one token that never reloads (the workers' shared token)."""
        table = cls.__new__(cls)
        table.path, table.flag, table.reload_seconds = "", "", float("inf")
        table._lock = threading.Lock()
        table._stamp = None
        table._table = {_digest(token): tenant}
        table._checked = time.monotonic()
        return table

    def _file_stamp(self):
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _load(self) -> dict[bytes, str]:
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TokenFileError(f"{self.flag}={self.path}: cannot read the file ({exc})") from None
        return parse_tokens(text, f"{self.flag}={self.path}")

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.reload_seconds:
            return
        with self._lock:
            if now - self._checked < self.reload_seconds:
                return
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp or stamp is None:
                return
            try:
                self._table = self._load()
                self._stamp = stamp
                log.info("token file reloaded", extra={"path": self.path, "tokens": len(self._table)})
            except TokenFileError as exc:
                log.error("token file changed but cannot be used; keeping the previous tokens: %s", exc)

    def tenant(self, token: str) -> str | None:
        self._maybe_reload()
        digest, found = _digest(token), None
        for known, tenant in self._table.items():  # every entry, whatever matched: constant time per table
            if hmac.compare_digest(digest, known):
                found = tenant
        return found

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> tuple[str | None, str]:
        """(tenant, "") for a known bearer token in ``metadata``; else (None, why it was refused)."""
        values = [v for k, v in (metadata or ()) if k == AUTHORIZATION]
        if not values:
            return None, "missing 'authorization' metadata: send 'authorization: Bearer <token>'"
        if len(values) > 1:
            return None, "more than one 'authorization' metadata entry; send exactly one"
        value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, "the 'authorization' metadata must be 'Bearer <token>'"
        tenant = self.tenant(token.strip())
        if tenant is None:
            return None, "the bearer token is not valid"
        return tenant, ""


def _denying_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that ends the call with ``code`` without reading the request."""

    async def deny(request_or_iterator, context):
        await context.abort(code, message)

    kind = (handler.request_streaming, handler.response_streaming)
    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[kind]
    # No request deserializer: a refused caller's bytes are never parsed.
    return factory(deny, request_deserializer=None, response_serializer=handler.response_serializer)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for calls to the guarded methods without a known bearer token; see the module docstring."""

    def __init__(self, tokens: TokenTable, guarded_prefixes: Sequence[str]) -> None:
        self.tokens = tokens
        self.guarded = tuple(guarded_prefixes)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self.guarded):
            return handler
        tenant, problem = self.tokens.authenticate(handler_call_details.invocation_metadata)
        if tenant is not None:
            return handler
        log.info("call refused: %s", problem, extra={"method": handler_call_details.method})
        return _denying_handler(handler, grpc.StatusCode.UNAUTHENTICATED, problem)
