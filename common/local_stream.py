"""The Step stream over a Unix-domain socket, for ranks on the scheduler's own machine.

gRPC's Python asyncio stack hands every message through its completion-queue threads: on the 2-core reference VM a
write and a read between two processes cost ~240 µs against ~113 µs on a plain socket, and a decode step pays that
twice, in CPU both processes share with the forward. A rank started with ``--step-socket PATH`` also serves its Step
stream there, and a scheduler whose ``--workers`` entry is ``local:PATH`` opens its stream that way (``mmcast
serve-local`` does both). The messages are the same ``StepRequest`` / ``StepResponse`` protobufs and the rank's
servicer is the same code: only the transport differs.

Frames: a 1-byte kind and a 4-byte little-endian length, then the bytes.

- ``HELLO`` (client, first): the call's metadata as ``key: value`` lines (the ranks' shared token,
  ``authorization: Bearer ...``), checked as the gRPC server checks it;
- ``MESSAGE``: one serialized protobuf;
- ``STATUS`` (server, last): the status code's number, a newline, the details; the stream's end, as a gRPC
  status ends a call.

A frame longer than the side's message limit ends the stream with ``RESOURCE_EXHAUSTED``, as gRPC's limit does.
The socket file is the rank's (mode 0600 in the folder the operator gave); docs/SECURITY.md says what guards it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import stat
import struct
from collections.abc import Callable, Sequence

import grpc

from common.parse_guard import safe_deserializer

log = logging.getLogger(__name__)

PREFIX = "local:"  # a --workers entry naming a rank's socket: local:/path/to/rank0.sock
HELLO, MESSAGE, STATUS = 1, 2, 3
_HEADER = struct.Struct("<BI")
HELLO_TIMEOUT_SECONDS = 10.0
_MAX_HELLO_BYTES = 64 << 10


def is_local(address: str) -> bool:
    return address.startswith(PREFIX)


def socket_path(address: str) -> str:
    return address[len(PREFIX) :]


def _frame(kind: int, body: bytes) -> bytes:
    return _HEADER.pack(kind, len(body)) + body


class FrameTooLarge(Exception):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"a frame of {size} bytes exceeds the limit of {limit} bytes")


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> tuple[int, bytes]:
    """(kind, body); raises ``asyncio.IncompleteReadError`` at the stream's end, ``FrameTooLarge``."""
    kind, size = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > limit:
        raise FrameTooLarge(size, limit)
    return kind, await reader.readexactly(size)


@dataclasses.dataclass(frozen=True)
class _Refusal:
    """What the reader task found instead of a message: the stream ends with this status."""

    code: grpc.StatusCode
    details: str


class StreamAborted(Exception):
    """``LocalContext.abort`` ended the stream (as ``grpc.aio.AbortError`` ends a gRPC handler)."""


class LocalContext:
    """What ``WorkerServicer.Step`` uses of a ``grpc.aio.ServicerContext``, over one connection: ``read``,
    ``write``, ``abort``. Frames are read by one task into a queue, so a ``read`` the servicer cancels (it reads
    beside a running step) loses nothing."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, parse: Callable, limit: int) -> None:
        self.reader, self.writer, self.parse, self.limit = reader, writer, parse, limit
        self.frames: asyncio.Queue = asyncio.Queue()
        self._reader_task: asyncio.Task | None = None
        self.closed = False

    def start_reading(self) -> None:
        self._reader_task = asyncio.create_task(self._read_all())

    async def _read_all(self) -> None:
        try:
            while True:
                kind, body = await _read_frame(self.reader, self.limit)
                if kind != MESSAGE:
                    why = f"unexpected frame kind {kind} on a Step stream"
                    self.frames.put_nowait(_Refusal(grpc.StatusCode.INVALID_ARGUMENT, why))
                    return
                self.frames.put_nowait(body)
        except FrameTooLarge as exc:
            self.frames.put_nowait(
                _Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED, f"received message larger than max: {exc}")
            )
        except (asyncio.IncompleteReadError, ConnectionError):
            self.frames.put_nowait(None)

    async def read(self):
        """The next ``StepRequest`` (or ``Unparsable``), or ``grpc.aio.EOF`` when the client closed the stream."""
        item = await self.frames.get()
        if item is None:
            self.frames.put_nowait(None)  # every later read sees the end too
            return grpc.aio.EOF
        if isinstance(item, _Refusal):
            await self.abort(item.code, item.details)
        return self.parse(item)

    async def write(self, message) -> None:
        if self.closed:
            raise ConnectionResetError("the Step stream is closed")
        self.writer.write(_frame(MESSAGE, message.SerializeToString()))
        await self.writer.drain()

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        """Writes the status and ends the stream; raises ``StreamAborted`` (never returns)."""
        if not self.closed:
            self.closed = True
            with contextlib.suppress(ConnectionError, RuntimeError):
                self.writer.write(_frame(STATUS, f"{code.value[0]}\n{details}".encode()))
                await self.writer.drain()
        raise StreamAborted(details)

    def close(self) -> None:
        self.closed = True
        if self._reader_task is not None:
            self._reader_task.cancel()
        self.writer.close()


def _metadata(body: bytes) -> list[tuple[str, str]]:
    out = []
    for line in body.decode("utf-8", "replace").splitlines():
        key, sep, value = line.partition(": ")
        if sep:
            out.append((key.strip().lower(), value))
    return out


class LocalStepServer:
    """Serves ``servicer.Step`` on the socket at ``path``; ``tokens`` (a ``common.auth.TokenTable``, or None
    where the rank takes unauthenticated streams) checks each stream's hello as the gRPC interceptor checks its
    metadata."""

    def __init__(self, path: str, servicer, request_parser: Callable, tokens, limit: int) -> None:
        self.path = path
        self.servicer = servicer
        self.parse = safe_deserializer(request_parser)
        self.tokens = tokens
        self.limit = limit
        self._server: asyncio.base_events.Server | None = None
        self._contexts: set[LocalContext] = set()

    async def start(self) -> None:
        try:
            if stat.S_ISSOCK(os.lstat(self.path).st_mode):
                os.unlink(self.path)  # a socket left by an earlier run of this rank (a crash leaves it)
            else:
                raise FileExistsError(f"--step-socket {self.path} exists and is not a socket; refusing to replace it")
        except FileNotFoundError:
            pass
        old = os.umask(0o177)  # the socket is born 0600: no moment in which another user may connect
        try:
            self._server = await asyncio.start_unix_server(self._serve, self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for ctx in list(self._contexts):
                ctx.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ctx = LocalContext(reader, writer, self.parse, self.limit)
        self._contexts.add(ctx)
        try:
            kind, body = await asyncio.wait_for(_read_frame(reader, _MAX_HELLO_BYTES), HELLO_TIMEOUT_SECONDS)
            if kind != HELLO:
                await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "a local Step stream must open with its hello")
            if self.tokens is not None:
                tenant, problem = self.tokens.authenticate(_metadata(body))
                if tenant is None:
                    log.info("local Step stream refused: %s", problem, extra={"socket": self.path})
                    await ctx.abort(grpc.StatusCode.UNAUTHENTICATED, problem)
            ctx.start_reading()
            await self.servicer.Step(None, ctx)
            if not ctx.closed:
                await ctx.abort(grpc.StatusCode.OK, "")
        except (StreamAborted, asyncio.CancelledError):
            pass  # aborted by the servicer, or the server is closing: the connection task ends quietly
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, FrameTooLarge):
            pass  # the client left, or never said hello
        except Exception:  # a bug in the servicer: its stream ends INTERNAL, as a gRPC handler's would
            log.exception("local Step stream failed", extra={"socket": self.path})
            with contextlib.suppress(StreamAborted):
                await ctx.abort(grpc.StatusCode.INTERNAL, "the rank failed serving the stream")
        finally:
            self._contexts.discard(ctx)
            ctx.close()


class LocalStreamError(RuntimeError):
    """The socket failed (refused, reset, an oversized frame): the rank is unreachable, as a broken gRPC stream."""


class LocalStepCall:
    """The scheduler's side of one local Step stream, with the methods ``RankStream`` uses of a gRPC
    stream-stream call: ``write(bytes)``, ``read()`` (bytes or ``grpc.aio.EOF``), ``code()``, ``details()``,
    ``cancel()``. It connects on the first write."""

    def __init__(self, path: str, metadata: Sequence[tuple[str, str]], limit: int) -> None:
        self.path = path
        self.metadata = tuple(metadata)
        self.limit = limit
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._code: grpc.StatusCode | None = None
        self._details = ""

    async def _open(self) -> None:
        if self._writer is not None:
            return
        if self._code is not None:
            raise LocalStreamError(f"the local Step stream at {self.path} has ended ({self._code.name})")
        try:
            self._reader, self._writer = await asyncio.open_unix_connection(self.path)
        except OSError as exc:
            self._end(grpc.StatusCode.UNAVAILABLE, f"cannot connect to {self.path}: {exc}")
            raise LocalStreamError(self._details) from None
        hello = "".join(f"{k}: {v}\n" for k, v in self.metadata).encode()
        self._writer.write(_frame(HELLO, hello))

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        if self._code is None:
            self._code, self._details = code, details

    async def write(self, raw: bytes) -> None:
        await self._open()
        if self._code is not None:
            raise LocalStreamError(f"the local Step stream at {self.path} has ended ({self._code.name})")
        try:
            self._writer.write(_frame(MESSAGE, raw))
            await self._writer.drain()
        except (ConnectionError, RuntimeError) as exc:
            self._end(grpc.StatusCode.UNAVAILABLE, f"write to {self.path} failed: {exc!r}")
            raise LocalStreamError(self._details) from None

    async def read(self):
        await self._open()
        if self._code is not None:
            return grpc.aio.EOF
        try:
            kind, body = await _read_frame(self._reader, self.limit)
        except (asyncio.IncompleteReadError, ConnectionError):
            self._end(grpc.StatusCode.UNAVAILABLE, f"the rank closed the stream at {self.path}")
            return grpc.aio.EOF
        except FrameTooLarge as exc:
            self._end(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise LocalStreamError(f"{self.path}: {exc}") from None
        if kind == STATUS:
            number, _, details = body.decode("utf-8", "replace").partition("\n")
            code = next((c for c in grpc.StatusCode if str(c.value[0]) == number), grpc.StatusCode.UNKNOWN)
            self._end(code, details)
            return grpc.aio.EOF
        if kind != MESSAGE:
            self._end(grpc.StatusCode.INTERNAL, f"unexpected frame kind {kind} from {self.path}")
            return grpc.aio.EOF
        return body

    async def code(self) -> grpc.StatusCode:
        return self._code or grpc.StatusCode.OK

    async def details(self) -> str:
        return self._details

    def cancel(self) -> None:
        self._end(grpc.StatusCode.CANCELLED, "cancelled by the scheduler")
        if self._writer is not None:
            self._writer.close()


__all__ = ["PREFIX", "LocalStepCall", "LocalStepServer", "LocalStreamError", "is_local", "socket_path"]
