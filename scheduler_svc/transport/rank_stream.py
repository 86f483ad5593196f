"""One rank's Step stream as the scheduler holds it: raw frames written under gRPC flow control, the handshake,
and a reader task that routes the rank's answers (step results, protocol errors, keepalives). Any failure is
``GroupDown`` (``rank_streams.WorkerGroup`` runs the group over these streams).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import grpc

from common.local_stream import LocalStepCall, is_local, socket_path
from mmcast.v1 import worker_pb2

STEP_METHOD = "/mmcast.v1.WorkerService/Step"
# A write to a stream that broke or finished raises one of these; all mean the rank is gone (a local stream's
# ``LocalStreamError`` is a RuntimeError).
WRITE_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, RuntimeError)


def auth_hint(code: grpc.StatusCode) -> str:
    if code != grpc.StatusCode.UNAUTHENTICATED:
        return ""
    return (
        " (give the scheduler the ranks' token with --worker-token-file, or a client certificate with --worker-tls-*)"
    )


class GroupDown(Exception):
    """The group cannot run steps until it is reconnected. The message says which rank and why."""


class RankStream:
    """One rank's stream: writes raw frames, and a reader task that routes the rank's answers."""

    def __init__(
        self,
        rank: int,
        address: str,
        channel: grpc.aio.Channel | None,
        on_bytes: Callable[[str, int], None],
        on_fail: Callable[[], None] = lambda: None,
        metadata: Sequence[tuple[str, str]] = (),
        max_message_bytes: int = 64 << 20,
    ):
        """``channel``: the rank's gRPC channel, None for a ``local:`` address (common/local_stream.py)."""
        self.rank = rank
        self.address = address
        self.channel = channel
        if is_local(address):
            self.call = LocalStepCall(socket_path(address), metadata, max_message_bytes)
        else:
            self.call = channel.stream_stream(STEP_METHOD, request_serializer=None, response_deserializer=None)(
                wait_for_ready=False, metadata=tuple(metadata) or None
            )
        self.results: asyncio.Queue[worker_pb2.StepResult] = asyncio.Queue()
        self.ack: worker_pb2.HandshakeAck | None = None
        self.failure: str | None = None
        self.failed = asyncio.Event()
        self.on_bytes = on_bytes
        self.on_fail = on_fail
        self.last_keepalive_rtt: float | None = None
        self.last_heard = time.monotonic()  # when the rank last sent anything
        self.writing = False  # a frame is being written (waiting on flow control while the link takes no bytes)
        self._reader: asyncio.Task | None = None

    async def write(self, raw: bytes, kind: str = "control") -> None:
        await self.write_raw(raw)
        self.on_bytes(kind, len(raw))

    async def write_raw(self, raw: bytes) -> None:
        """One frame, uncounted; ``writing`` is set while gRPC flow control holds it (a link taking no bytes)."""
        self.writing = True
        try:
            await self.call.write(raw)
        finally:
            self.writing = False

    async def handshake(self, hs: worker_pb2.Handshake, timeout: float) -> worker_pb2.HandshakeAck:
        try:
            await asyncio.wait_for(self.write(worker_pb2.StepRequest(handshake=hs).SerializeToString()), timeout)
            raw = await asyncio.wait_for(self.call.read(), timeout)
        except TimeoutError:
            raise GroupDown(f"rank {self.rank} ({self.address}): no handshake answer within {timeout:.1f}s") from None
        except grpc.aio.AioRpcError as exc:
            raise GroupDown(
                f"rank {self.rank} ({self.address}) refused the handshake: {exc.code().name}: {exc.details()}"
                + auth_hint(exc.code())
            ) from None
        except WRITE_ERRORS as exc:
            raise GroupDown(f"rank {self.rank} ({self.address}): handshake failed: {exc!r}") from None
        if raw is grpc.aio.EOF:
            code = await self.call.code()
            details = await self.call.details()
            raise GroupDown(
                f"rank {self.rank} ({self.address}) refused the handshake: {code.name}: {details}" + auth_hint(code)
            )
        frame = worker_pb2.StepResponse.FromString(raw)
        if frame.WhichOneof("frame") != "handshake_ack":
            raise GroupDown(f"rank {self.rank} answered the handshake with {frame.WhichOneof('frame')}")
        self.ack = frame.handshake_ack
        self._reader = asyncio.create_task(self._read_loop(), name=f"rank-{self.rank}-reader")
        return self.ack

    async def _read_loop(self) -> None:
        try:
            while True:
                raw = await self.call.read()
                if raw is grpc.aio.EOF:
                    code = await self.call.code()
                    self._fail(f"stream ended: {code.name}: {await self.call.details()}")
                    return
                frame = worker_pb2.StepResponse.FromString(raw)
                self.last_heard = time.monotonic()
                kind = frame.WhichOneof("frame")
                if kind == "step_result":
                    self.results.put_nowait(frame.step_result)
                elif kind == "error":
                    err = frame.error
                    self._fail(
                        f"protocol error {worker_pb2.ProtocolErrorCode.Name(err.code)} at step {err.step_id}: "
                        f"{err.message}"
                    )
                    return
                elif kind == "keepalive":
                    self.last_keepalive_rtt = (time.time_ns() - frame.keepalive.sent_unix_nanos) / 1e9
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            self._fail(f"stream broke: {exc.code().name}: {exc.details()}")
        except Exception as exc:  # a malformed answer is a broken rank, not a crash of the scheduler
            self._fail(f"unreadable answer: {exc!r}")

    def _fail(self, reason: str) -> None:
        if self.failure is None:
            self.failure = f"rank {self.rank} ({self.address}): {reason}"
            self.failed.set()
            self.on_fail()

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.call.cancel()
        if self.channel is not None:
            await self.channel.close(grace=None)
