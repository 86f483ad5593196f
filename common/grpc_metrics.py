"""Standard gRPC server metrics, exactly as go-grpc-prometheus exports them, as server interceptors.

``grpc_server_started_total`` and the ``grpc_server_handling_seconds`` histogram carry the labels ``grpc_type``
(unary, client_stream, server_stream, bidi_stream), ``grpc_service`` and ``grpc_method``;
``grpc_server_handled_total`` adds ``grpc_code``, spelled as Go's ``codes.Code.String()`` (``OK``, ``Canceled``,
``InvalidArgument``, ...), so dashboards and alerts written for Go services select our series unchanged.
``AioServerMetricsInterceptor`` serves ``grpc.aio`` servers and handles handlers that return a value, that are async
generators and that use ``context.read()``/``write()``; ``ServerMetricsInterceptor`` serves the synchronous server.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Iterable

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from prometheus_client import CollectorRegistry, Counter, Histogram

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800, 3600)
_LABELS = ("grpc_service", "grpc_method", "grpc_type")
# (request streaming, response streaming) -> grpc_type
_RPC_TYPES = {
    (False, False): "unary",
    (True, False): "client_stream",
    (False, True): "server_stream",
    (True, True): "bidi_stream",
}
_DEADLINE_SLACK_SECONDS = 0.05  # a cancellation this close to the deadline counts as DeadlineExceeded

# grpc_code values: Go's codes.Code.String(). Python's names differ in case and in one spelling (CANCELLED).
GO_CODE_NAMES: dict[grpc.StatusCode, str] = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}
_GO_CODE_BY_NUMBER = {status.value[0]: name for status, name in GO_CODE_NAMES.items()}


class GrpcServerMetrics:
    def __init__(self, registry: CollectorRegistry, services: Iterable[ServiceDescriptor] = ()) -> None:
        self.started = Counter(
            "grpc_server_started", "Total number of RPCs started on the server.", _LABELS, registry=registry
        )
        self.handled = Counter(
            "grpc_server_handled",
            "Total number of RPCs completed on the server, regardless of success or failure.",
            (*_LABELS, "grpc_code"),
            registry=registry,
        )
        self.seconds = Histogram(  # no grpc_code, as in go-grpc-prometheus
            "grpc_server_handling_seconds",
            "Histogram of response latency (seconds) of gRPC that had been application-level handled by the server.",
            _LABELS,
            buckets=_BUCKETS,
            registry=registry,
        )
        self._methods: set[tuple[str, str, str]] = set()
        self.initialize(*services)

    def initialize(self, *services: ServiceDescriptor) -> None:
        """Creates the series of every method of these protobuf services before their first call."""
        for service in services:
            for m in service.methods:
                rpc_type = _RPC_TYPES[m.client_streaming, m.server_streaming]
                self.method_seen((service.full_name, m.name, rpc_type))

    def method_seen(self, labels: tuple[str, str, str]) -> None:
        """Creates a method's series at 0 with every grpc_code, as go-grpc-prometheus's InitializeMetrics does: the
        first error of a kind then shows in rate() as a rise from 0, not as a series that appears already at 1."""
        if labels in self._methods:
            return
        self._methods.add(labels)
        self.started.labels(*labels)
        self.seconds.labels(*labels)
        for code in GO_CODE_NAMES.values():
            self.handled.labels(*labels, code)


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return service or "unknown", name or "unknown"


def _rpc_type(handler: grpc.RpcMethodHandler) -> str:
    return _RPC_TYPES[bool(handler.request_streaming), bool(handler.response_streaming)]


def _behavior_and_factory(handler: grpc.RpcMethodHandler):
    if handler.unary_unary:
        return handler.unary_unary, grpc.unary_unary_rpc_method_handler
    if handler.unary_stream:
        return handler.unary_stream, grpc.unary_stream_rpc_method_handler
    if handler.stream_unary:
        return handler.stream_unary, grpc.stream_unary_rpc_method_handler
    return handler.stream_stream, grpc.stream_stream_rpc_method_handler


def go_code_name(code: grpc.StatusCode | int) -> str:
    """Go's spelling of a status code (``Code(42)`` for a number outside the standard ones, as Go prints it)."""
    if isinstance(code, grpc.StatusCode):
        return GO_CODE_NAMES[code]
    return _GO_CODE_BY_NUMBER.get(code, f"Code({code})")


def _code_of(context, exc: BaseException | None) -> str:
    # The RPC ended under the handler: the client cancelled or its deadline passed. An async handler is cancelled;
    # a response generator is closed at its `yield` (GeneratorExit) when the stream is abandoned.
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        try:
            remaining = context.time_remaining()
        except Exception:
            remaining = None
        # The client's own deadline timer may cancel the stream a moment before the server's fires.
        return "DeadlineExceeded" if remaining is not None and remaining < _DEADLINE_SLACK_SECONDS else "Canceled"
    try:
        code = context.code()
    except Exception:  # some contexts only know the code once the RPC is over
        code = None
    if isinstance(code, (grpc.StatusCode, int)):
        return go_code_name(code)
    return "Unknown" if exc is not None else "OK"  # gRPC answers an uncaught exception with UNKNOWN


class _Recorder:
    def __init__(self, metrics: GrpcServerMetrics, labels: tuple[str, str, str]) -> None:
        self.metrics, self.labels = metrics, labels
        metrics.started.labels(*labels).inc()
        self.t0 = time.perf_counter()

    def done(self, context, exc: BaseException | None) -> None:
        code = _code_of(context, exc)
        self.metrics.handled.labels(*self.labels, code).inc()
        self.metrics.seconds.labels(*self.labels).observe(time.perf_counter() - self.t0)


class AioServerMetricsInterceptor(grpc.aio.ServerInterceptor):
    """`services`: protobuf service descriptors whose methods get their series before the first call (any other
    method gets them on its first call)."""

    def __init__(self, registry: CollectorRegistry, services: Iterable[ServiceDescriptor] = ()) -> None:
        self.metrics = GrpcServerMetrics(registry, services)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        service, method = _split(handler_call_details.method)
        labels = (service, method, _rpc_type(handler))
        behavior, factory = _behavior_and_factory(handler)
        metrics = self.metrics
        metrics.method_seen(labels)

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

    def __init__(self, registry: CollectorRegistry, services: Iterable[ServiceDescriptor] = ()) -> None:
        self.metrics = GrpcServerMetrics(registry, services)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        service, method = _split(handler_call_details.method)
        labels = (service, method, _rpc_type(handler))
        behavior, factory = _behavior_and_factory(handler)
        metrics = self.metrics
        metrics.method_seen(labels)

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
