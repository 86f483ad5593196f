"""The Step stream over a Unix-domain socket (common/local_stream.py): what a gRPC stream guarantees its two ends —
the token checked before the servicer sees a frame, statuses with their code and details, oversized and
unparsable frames refused, a peer's death seen as the stream's end — holds on the socket too. The servicer here
is a small echo; the real one runs behind this transport in every serve-local test."""

from __future__ import annotations

import asyncio
import os
import stat

import grpc
import pytest

from common import local_stream
from common.auth import TokenTable
from common.parse_guard import Unparsable
from mmcast.v1 import worker_pb2

TOKEN = "t0ken-of-the-group-0123456789"


class Echo:
    """Answers every keepalive with its own; aborts on an unparsable frame or a control with step_id 99; raises on
    step_id 98 (a bug)."""

    def __init__(self) -> None:
        self.seen: list = []

    async def Step(self, request_iterator, context):
        while True:
            frame = await context.read()
            if frame is grpc.aio.EOF:
                return
            self.seen.append(frame)
            if isinstance(frame, Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, frame.message)
            if frame.WhichOneof("frame") == "control" and frame.control.step_id == 99:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "step 99 refused")
            if frame.WhichOneof("frame") == "control" and frame.control.step_id == 98:
                raise RuntimeError("a bug in the servicer")
            await context.write(worker_pb2.StepResponse(keepalive=frame.keepalive))


def _serve(tmp_path, body, tokens=TokenTable.single(TOKEN, "scheduler"), limit=1 << 20):
    async def main():
        path = str(tmp_path / "rank0.sock")
        echo = Echo()
        server = local_stream.LocalStepServer(path, echo, worker_pb2.StepRequest.FromString, tokens, limit)
        await server.start()
        try:
            return await body(path, echo)
        finally:
            await server.close()

    return asyncio.run(main())


def _keepalive(n: int) -> bytes:
    return worker_pb2.StepRequest(keepalive=worker_pb2.Keepalive(sent_unix_nanos=n)).SerializeToString()


def _control(step_id: int) -> bytes:
    return worker_pb2.StepRequest(control=worker_pb2.StepControl(step_id=step_id)).SerializeToString()


def _call(path, token=TOKEN, limit=1 << 20):
    return local_stream.LocalStepCall(path, [("authorization", f"Bearer {token}")] if token else [], limit)


def test_frames_go_both_ways_in_order_and_the_socket_is_the_owners_alone(tmp_path):
    async def body(path, echo):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        call = _call(path)
        for n in (1, 2, 3):
            await call.write(_keepalive(n))
        answers = [worker_pb2.StepResponse.FromString(await call.read()).keepalive.sent_unix_nanos for _ in range(3)]
        assert answers == [1, 2, 3]
        call.cancel()
        return await call.code()

    assert _serve(tmp_path, body) == grpc.StatusCode.CANCELLED
    assert not (tmp_path / "rank0.sock").exists()  # closing the server removes its socket


@pytest.mark.parametrize("token", ["wrong-token-of-the-group-000000", None])
def test_a_stream_without_the_token_is_refused_before_the_servicer_reads_a_frame(tmp_path, token):
    async def body(path, echo):
        call = _call(path, token)
        await call.write(_keepalive(1))
        assert await call.read() is grpc.aio.EOF
        return await call.code(), await call.details(), echo.seen

    code, details, seen = _serve(tmp_path, body)
    assert code == grpc.StatusCode.UNAUTHENTICATED and seen == []
    assert ("not valid" if token else "missing 'authorization'") in details


def test_statuses_carry_their_code_and_details_and_end_the_stream(tmp_path):
    async def body(path, echo):
        out = []
        for frame in (_control(99), b"\xff\xff not a protobuf", _control(98)):
            call = _call(path)
            await call.write(frame)
            assert await call.read() is grpc.aio.EOF
            out.append((await call.code(), await call.details()))
            with pytest.raises(local_stream.LocalStreamError):
                await call.write(_keepalive(2))  # ended: a write fails as one to a broken gRPC stream does
        return out

    (refused, unparsable, bug) = _serve(tmp_path, body)
    assert refused == (grpc.StatusCode.FAILED_PRECONDITION, "step 99 refused")
    assert unparsable[0] == grpc.StatusCode.INVALID_ARGUMENT and "mmcast.v1.StepRequest" in unparsable[1]
    assert bug[0] == grpc.StatusCode.INTERNAL


def test_a_frame_of_another_kind_mid_stream_ends_it(tmp_path):
    async def body(path, echo):
        call = _call(path)
        await call.write(_keepalive(1))
        assert await call.read() is not grpc.aio.EOF
        call._writer.write(local_stream._frame(local_stream.HELLO, b"authorization: Bearer x\n"))  # a second hello
        assert await call.read() is grpc.aio.EOF
        return await call.code(), await call.details(), len(echo.seen)

    assert _serve(tmp_path, body) == (grpc.StatusCode.INVALID_ARGUMENT, "unexpected frame kind 1 on a Step stream", 1)


def test_a_frame_over_the_limit_is_refused_on_either_side(tmp_path):
    async def body(path, echo):
        call = _call(path)
        await call.write(_keepalive(1))  # a small one passes
        assert await call.read() is not grpc.aio.EOF
        await call.write(
            worker_pb2.StepRequest(payload=worker_pb2.PayloadFrame(item_identifier="x" * 5000)).SerializeToString()
        )
        assert await call.read() is grpc.aio.EOF
        server_side = await call.code(), await call.details()
        small = _call(path, limit=4)  # the scheduler's own limit on what it reads
        await small.write(_keepalive(1 << 40))  # answered with a 9-byte message
        with pytest.raises(local_stream.LocalStreamError):
            await small.read()
        return server_side, await small.code()

    (code, details), client_side = _serve(tmp_path, body, limit=4096)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "4096" in details
    assert client_side == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_missing_rank_is_a_connection_error_the_group_treats_as_down(tmp_path):
    async def main():
        call = _call(str(tmp_path / "nobody.sock"))
        with pytest.raises(local_stream.LocalStreamError, match="cannot connect"):
            await call.write(_keepalive(1))
        return await call.code()

    assert asyncio.run(main()) == grpc.StatusCode.UNAVAILABLE


def test_a_stale_socket_is_replaced_and_any_other_file_is_not(tmp_path):
    import socket

    stale = tmp_path / "rank0.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))  # left behind, as a killed rank leaves its socket
    s.close()

    async def body(path, echo):
        call = _call(path)
        await call.write(_keepalive(5))
        return worker_pb2.StepResponse.FromString(await call.read()).keepalive.sent_unix_nanos

    assert _serve(tmp_path, body) == 5
    other = tmp_path / "rank0.sock"
    other.write_text("not a socket")

    async def refuse():
        server = local_stream.LocalStepServer(str(other), Echo(), worker_pb2.StepRequest.FromString, None, 1024)
        with pytest.raises(FileExistsError, match="not a socket"):
            await server.start()

    asyncio.run(refuse())
    assert other.read_text() == "not a socket"
