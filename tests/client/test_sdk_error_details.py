"""google.rpc error details (gRPC's rich error model) on the SDK's exceptions, from a real gRPC server that aborts
with them the way the scheduler does: BadRequest naming the request field, RetryInfo on RESOURCE_EXHAUSTED and
UNAVAILABLE, ResourceInfo naming an image."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from mmcast.v1 import generation_pb2_grpc as pb_grpc
from mmcast_client import (
    AsyncClient,
    Client,
    FieldViolation,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ResourceInfo,
    Unavailable,
)

IMAGE_SHA = "ab" * 32


def packed(*messages) -> list[any_pb2.Any]:
    out = []
    for message in messages:
        a = any_pb2.Any()
        a.Pack(message)
        out.append(a)
    return out


def bad_request() -> status_pb2.Status:
    violations = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field="messages[0].content[1].image", description="4000x4000 pixels exceed --max-image-pixels"
            ),
            error_details_pb2.BadRequest.FieldViolation(field="sampling.max_tokens", description="must be >= 1"),
        ]
    )
    return status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="bad request", details=packed(violations))


def exhausted() -> status_pb2.Status:
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=2, nanos=500_000_000))
    return status_pb2.Status(code=code_pb2.RESOURCE_EXHAUSTED, message="queue full", details=packed(retry))


def unavailable() -> status_pb2.Status:
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(nanos=250_000_000))
    return status_pb2.Status(code=code_pb2.UNAVAILABLE, message="group down", details=packed(retry))


def missing_image() -> status_pb2.Status:
    info = error_details_pb2.ResourceInfo(
        resource_type="image", resource_name=IMAGE_SHA, description="not stored on this replica; upload it again"
    )
    return status_pb2.Status(code=code_pb2.NOT_FOUND, message=f"image {IMAGE_SHA} not found", details=packed(info))


class AbortingServicer(pb_grpc.GenerationServiceServicer):
    """Answers every call with the next queued google.rpc.Status."""

    def __init__(self) -> None:
        self.statuses: list[status_pb2.Status] = []
        self.calls = 0

    def _abort(self, context):
        self.calls += 1
        context.abort_with_status(rpc_status.to_status(self.statuses.pop(0)))

    def Generate(self, request, context):
        self._abort(context)
        yield  # a server-streaming handler

    def GetServerInfo(self, request, context):
        self._abort(context)


@pytest.fixture
def server():
    servicer = AbortingServicer()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_GenerationServiceServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield servicer, f"127.0.0.1:{port}"
    srv.stop(grace=None)


def check_bad_request(e: InvalidArgument) -> None:
    assert e.field_violations == [
        FieldViolation("messages[0].content[1].image", "4000x4000 pixels exceed --max-image-pixels"),
        FieldViolation("sampling.max_tokens", "must be >= 1"),
    ]
    assert e.field_violations[0].field == "messages[0].content[1].image"  # a (field, description) pair with names
    assert e.retry_delay is None and e.resource_info is None and e.message == "bad request"


def test_sync_client_exposes_bad_request_retry_info_and_resource_info(server):
    servicer, target = server
    servicer.statuses = [bad_request(), exhausted(), missing_image()]
    with Client(target, retries=0) as client:
        with pytest.raises(InvalidArgument) as bad:
            client.generate("x", max_tokens=1)
        check_bad_request(bad.value)
        with pytest.raises(ResourceExhausted) as full:
            client.get_server_info()
        assert full.value.retry_delay == pytest.approx(2.5) and full.value.field_violations == []
        with pytest.raises(NotFound) as missing:
            client.generate("x", max_tokens=1)  # no image bytes here, so no inline retry: NOT_FOUND reaches us
        assert missing.value.resource_info == ResourceInfo(
            "image", IMAGE_SHA, "not stored on this replica; upload it again"
        )


def test_async_client_exposes_the_same_details(server):
    servicer, target = server
    servicer.statuses = [bad_request(), unavailable()]

    async def run():
        async with AsyncClient(target, retries=0) as client:
            with pytest.raises(InvalidArgument) as bad:
                await client.generate("x", max_tokens=1)
            check_bad_request(bad.value)
            with pytest.raises(Unavailable) as down:
                await client.get_server_info()
            return down.value

    down = asyncio.run(run())
    assert down.retry_delay == pytest.approx(0.25) and down.message == "group down"


def test_an_error_without_details_has_empty_ones(server):
    servicer, target = server
    servicer.statuses = [status_pb2.Status(code=code_pb2.INVALID_ARGUMENT, message="plain")]
    with Client(target, retries=0) as client, pytest.raises(InvalidArgument) as info:
        client.get_server_info()
    assert (info.value.field_violations, info.value.retry_delay, info.value.resource_info) == ([], None, None)
