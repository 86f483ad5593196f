"""The gRPC server metrics interceptors: go-grpc-prometheus names, labels and Go's status-code spellings, on an
in-process aio server and a synchronous one (port 0, raw-bytes handlers, no protos)."""

from __future__ import annotations

import asyncio
import time
from concurrent import futures

import grpc
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from common.grpc_metrics import (
    GO_CODE_NAMES,
    AioServerMetricsInterceptor,
    ServerMetricsInterceptor,
    go_code_name,
)

SERVICE = "test.v1.Probe"
# Go's codes.Code.String() for every code, as go-grpc-prometheus writes grpc_code.
GO_SPELLING = {
    "OK": "OK",
    "CANCELLED": "Canceled",
    "UNKNOWN": "Unknown",
    "INVALID_ARGUMENT": "InvalidArgument",
    "DEADLINE_EXCEEDED": "DeadlineExceeded",
    "NOT_FOUND": "NotFound",
    "ALREADY_EXISTS": "AlreadyExists",
    "PERMISSION_DENIED": "PermissionDenied",
    "RESOURCE_EXHAUSTED": "ResourceExhausted",
    "FAILED_PRECONDITION": "FailedPrecondition",
    "ABORTED": "Aborted",
    "OUT_OF_RANGE": "OutOfRange",
    "UNIMPLEMENTED": "Unimplemented",
    "INTERNAL": "Internal",
    "UNAVAILABLE": "Unavailable",
    "DATA_LOSS": "DataLoss",
    "UNAUTHENTICATED": "Unauthenticated",
}


def test_every_status_code_has_its_go_spelling():
    assert {status.name: name for status, name in GO_CODE_NAMES.items()} == GO_SPELLING
    assert set(GO_CODE_NAMES) == set(grpc.StatusCode)
    assert go_code_name(grpc.StatusCode.CANCELLED.value[0]) == "Canceled"
    assert go_code_name(3) == "InvalidArgument" and go_code_name(42) == "Code(42)"


def test_a_method_gets_every_code_at_zero_on_first_sight_and_services_up_front():
    from grpc_health.v1 import health_pb2

    registry = CollectorRegistry()
    metrics = AioServerMetricsInterceptor(registry, services=[health_pb2.DESCRIPTOR.services_by_name["Health"]]).metrics
    check = {"grpc_service": "grpc.health.v1.Health", "grpc_method": "Check", "grpc_type": "unary"}
    watch = {**check, "grpc_method": "Watch", "grpc_type": "server_stream"}
    for labels in (check, watch):
        assert registry.get_sample_value("grpc_server_started_total", labels) == 0
        assert registry.get_sample_value("grpc_server_handling_seconds_count", labels) == 0
        for code in GO_SPELLING.values():
            assert registry.get_sample_value("grpc_server_handled_total", {**labels, "grpc_code": code}) == 0
    metrics.method_seen((SERVICE, "Ok", "unary"))
    ok = {"grpc_service": SERVICE, "grpc_method": "Ok", "grpc_type": "unary", "grpc_code": "Internal"}
    assert registry.get_sample_value("grpc_server_handled_total", ok) == 0


# -- an aio server ------------------------------------------------------------------------------------------------
def _aio_handlers(started_stream: asyncio.Event) -> grpc.GenericRpcHandler:
    async def ok(request, context):
        return request

    async def invalid(request, context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "field x=1 must be 0")

    async def set_code(request, context):
        context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
        context.set_details("queue full")
        return b""

    async def boom(request, context):
        raise RuntimeError("a bug")

    async def forever(request, context):
        started_stream.set()
        while True:
            yield b"x"
            await asyncio.sleep(0.01)

    async def slow(request, context):
        await asyncio.sleep(10)
        return b""

    async def count(request_iterator, context):
        return str(len([r async for r in request_iterator])).encode()

    async def echo(request_iterator, context):
        async for r in request_iterator:
            yield r

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Ok": grpc.unary_unary_rpc_method_handler(ok),
            "Invalid": grpc.unary_unary_rpc_method_handler(invalid),
            "SetCode": grpc.unary_unary_rpc_method_handler(set_code),
            "Boom": grpc.unary_unary_rpc_method_handler(boom),
            "Slow": grpc.unary_unary_rpc_method_handler(slow),
            "Forever": grpc.unary_stream_rpc_method_handler(forever),
            "Count": grpc.stream_unary_rpc_method_handler(count),
            "Echo": grpc.stream_stream_rpc_method_handler(echo),
        },
    )


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


def _handled(registry, method, rpc_type, code) -> float:
    return _value(
        registry,
        "grpc_server_handled_total",
        grpc_service=SERVICE,
        grpc_method=method,
        grpc_type=rpc_type,
        grpc_code=code,
    )


async def _until(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.01)
    return predicate()


async def _aio_round(registry: CollectorRegistry) -> None:
    started_stream = asyncio.Event()
    server = grpc.aio.server(interceptors=[AioServerMetricsInterceptor(registry)])
    server.add_generic_rpc_handlers((_aio_handlers(started_stream),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:

            def call(name, kind="unary_unary"):
                return getattr(channel, kind)(f"/{SERVICE}/{name}")

            assert await call("Ok")(b"hi") == b"hi"
            for name, code in (
                ("Invalid", grpc.StatusCode.INVALID_ARGUMENT),
                ("SetCode", grpc.StatusCode.RESOURCE_EXHAUSTED),
                ("Boom", grpc.StatusCode.UNKNOWN),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await call(name)(b"")
                assert info.value.code() == code
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call("Slow")(b"", timeout=0.2)
            assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert await call("Count", "stream_unary")(iter([b"a", b"b"])) == b"2"
            assert [r async for r in call("Echo", "stream_stream")(iter([b"a", b"b"]))] == [b"a", b"b"]
            stream = call("Forever", "unary_stream")(b"")
            await stream.read()
            await started_stream.wait()
            stream.cancel()
            assert await _until(lambda: _handled(registry, "Forever", "server_stream", "Canceled") == 1)
            assert await _until(lambda: _handled(registry, "Slow", "unary", "DeadlineExceeded") == 1), generate_latest(
                registry
            ).decode()
    finally:
        await server.stop(None)


def test_aio_interceptor_counts_every_rpc_type_with_go_codes():
    registry = CollectorRegistry()
    asyncio.run(_aio_round(registry))
    expected = {
        ("Ok", "unary", "OK"),
        ("Invalid", "unary", "InvalidArgument"),
        ("SetCode", "unary", "ResourceExhausted"),
        ("Boom", "unary", "Unknown"),
        ("Slow", "unary", "DeadlineExceeded"),
        ("Count", "client_stream", "OK"),
        ("Echo", "bidi_stream", "OK"),
        ("Forever", "server_stream", "Canceled"),
    }
    for method, rpc_type, code in expected:
        assert _handled(registry, method, rpc_type, code) == 1, (method, code)
        assert _handled(registry, method, rpc_type, "DataLoss") == 0, "every code exists from the first call"
        labels = {"grpc_service": SERVICE, "grpc_method": method, "grpc_type": rpc_type}
        assert _value(registry, "grpc_server_started_total", **labels) == 1, method
        assert _value(registry, "grpc_server_handling_seconds_count", **labels) == 1, method
    _assert_go_label_sets(registry)


def _assert_go_label_sets(registry: CollectorRegistry) -> None:
    """The label names of go-grpc-prometheus: grpc_code on handled_total only; every code in Go's spelling."""
    names = {"grpc_service", "grpc_method", "grpc_type"}
    for family in registry.collect():
        for sample in family.samples:
            labels = set(sample.labels) - {"le"}
            if family.name == "grpc_server_handled":
                assert labels == names | {"grpc_code"}
                assert sample.labels["grpc_code"] in GO_SPELLING.values(), sample
            elif family.name.startswith("grpc_server_"):
                assert labels == names, sample
    text = generate_latest(registry).decode()
    assert "grpc_server_handling_seconds_bucket{grpc_method=" in text and "CANCELLED" not in text


# -- a synchronous server -----------------------------------------------------------------------------------------
def test_sync_interceptor_uses_the_same_names():
    def ok(request, context):
        return request

    def invalid(request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, "no such thing")

    def stream(request, context):
        yield b"a"
        yield b"b"

    registry = CollectorRegistry()
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[ServerMetricsInterceptor(registry)])
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Ok": grpc.unary_unary_rpc_method_handler(ok),
                    "Missing": grpc.unary_unary_rpc_method_handler(invalid),
                    "Stream": grpc.unary_stream_rpc_method_handler(stream),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert channel.unary_unary(f"/{SERVICE}/Ok")(b"x") == b"x"
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(f"/{SERVICE}/Missing")(b"")
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            assert list(channel.unary_stream(f"/{SERVICE}/Stream")(b"")) == [b"a", b"b"]
    finally:
        server.stop(None)
    assert _handled(registry, "Ok", "unary", "OK") == 1
    assert _handled(registry, "Missing", "unary", "NotFound") == 1
    assert _handled(registry, "Stream", "server_stream", "OK") == 1
    _assert_go_label_sets(registry)
