"""Standard gRPC server metrics (the names and labels of go-grpc-prometheus) as server interceptors.

``grpc_server_started_total``, ``grpc_server_handled_total`` and ``grpc_server_handling_seconds`` with labels
``grpc_service``, ``grpc_method``, ``grpc_type`` (unary, client_stream, server_stream, bidi_stream) and, on the
last two, ``grpc_code`` (OK, CANCELLED, ...). ``AioServerMetricsInterceptor`` serves ``grpc.aio`` servers and handles
handlers that return a value, that are async generators and that use ``context.read()``/``write()``;
``ServerMetricsInterceptor`` serves the synchronous server.
"""

from __future__ import annotations

import asyncio
import inspect
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)
_LABELS = ("grpc_service", "grpc_method", "grpc_type")


class GrpcServerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.started = Counter("grpc_server_started", "RPCs started on the server", _LABELS, registry=registry)
        self.handled = Counter(
            "grpc_server_handled",
            "RPCs completed on the server, regardless of success or failure",
            (*_LABELS, "grpc_code"),
            registry=registry,
        )
        self.seconds = Histogram(
            "grpc_server_handling_seconds",
            "Response latency (seconds) of RPCs handled by the server",
            (*_LABELS, "grpc_code"),
            buckets=_BUCKETS,
            registry=registry,
        )


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return service or "unknown", name or "unknown"


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming and handler.response_streaming:
        return "bidi_stream"
    if handler.request_streaming:
        return "client_stream"
    if handler.response_streaming:
        return "server_stream"
    return "unary"


def _behavior_and_factory(handler: grpc.RpcMethodHandler):
    if handler.unary_unary:
        return handler.unary_unary, grpc.unary_unary_rpc_method_handler
    if handler.unary_stream:
        return handler.unary_stream, grpc.unary_stream_rpc_method_handler
    if handler.stream_unary:
        return handler.stream_unary, grpc.stream_unary_rpc_method_handler
    return handler.stream_stream, grpc.stream_stream_rpc_method_handler


def _code_of(context, exc: BaseException | None) -> str:
    if isinstance(exc, asyncio.CancelledError):
        return "CANCELLED"
    code = None
    try:
        code = context.code()
    except Exception:  # some contexts only know the code once the RPC is over
        code = None
    if isinstance(code, grpc.StatusCode):
        return code.name
    if isinstance(code, int):
        for status in grpc.StatusCode:
            if status.value[0] == code:
                return status.name
    return "UNKNOWN" if exc is not None else "OK"


class _Recorder:
    def __init__(self, metrics: GrpcServerMetrics, labels: tuple[str, str, str]) -> None:
        self.metrics, self.labels = metrics, labels
        metrics.started.labels(*labels).inc()
        self.t0 = time.perf_counter()

    def done(self, context, exc: BaseException | None) -> None:
        code = _code_of(context, exc)
        self.metrics.handled.labels(*self.labels, code).inc()
        self.metrics.seconds.labels(*self.labels, code).observe(time.perf_counter() - self.t0)


class AioServerMetricsInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, registry: CollectorRegistry) -> None:
        self.metrics = GrpcServerMetrics(registry)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, method = _split(handler_call_details.method)
        labels = (service, method, _rpc_type(handler))
        behavior, factory = _behavior_and_factory(handler)
        metrics = self.metrics

        if inspect.isasyncgenfunction(behavior):

            async def wrapped_gen(request, context):
                rec, exc = _Recorder(metrics, labels), None
                try:
                    async for response in behavior(request, context):
                        yield response
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    rec.done(context, exc)

            wrapped = wrapped_gen
        else:

            async def wrapped_call(request, context):
                rec, exc = _Recorder(metrics, labels), None
                try:
                    result = behavior(request, context)
                    if inspect.isawaitable(result):
                        result = await result
                    return result
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    rec.done(context, exc)

            wrapped = wrapped_call
        return factory(
            wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )


class ServerMetricsInterceptor(grpc.ServerInterceptor):
    """The same metrics for a synchronous ``grpc.server``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.metrics = GrpcServerMetrics(registry)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, method = _split(handler_call_details.method)
        labels = (service, method, _rpc_type(handler))
        behavior, factory = _behavior_and_factory(handler)
        metrics = self.metrics

        if handler.response_streaming:

            def wrapped(request, context):
                rec, exc = _Recorder(metrics, labels), None
                try:
                    yield from behavior(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    rec.done(context, exc)

        else:

            def wrapped(request, context):
                rec, exc = _Recorder(metrics, labels), None
                try:
                    return behavior(request, context)
                except BaseException as e:
                    exc = e
                    raise
                finally:
                    rec.done(context, exc)

        return factory(
            wrapped, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
        )
