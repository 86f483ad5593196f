"""Requests that are not valid protobuf get INVALID_ARGUMENT naming the message type, not gRPC's UNKNOWN.

gRPC Python answers a request its deserializer cannot parse with UNKNOWN and the exception's repr — a status
clients treat as a server fault. ``ParseGuardInterceptor`` gives every handler a deserializer that never raises:
bytes that do not parse become an ``Unparsable`` marker, and the call ends with INVALID_ARGUMENT before the
servicer sees it (unary requests) or when the iterator reaches it (streamed requests). A servicer that reads a
stream with ``context.read()`` instead of the iterator checks ``isinstance(frame, Unparsable)`` itself.
"""

from __future__ import annotations

import dataclasses
import inspect

import grpc


@dataclasses.dataclass(frozen=True)
class Unparsable:
    """Stands in for a request message whose bytes did not parse."""

    type_name: str  # e.g. mmcast.v1.GenerateRequest
    size: int  # bytes received
    reason: str  # the parser's complaint

    @property
    def message(self) -> str:
        return f"the request is not a valid {self.type_name} ({self.size} bytes): {self.reason[:200]}"


def _type_name(deserializer) -> str:
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    return getattr(descriptor, "full_name", None) or "request message"


def safe_deserializer(deserializer):
    name = _type_name(deserializer)

    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # DecodeError, and whatever a custom deserializer raises
            return Unparsable(name, len(raw), str(exc) or type(exc).__name__)

    return parse


async def _checked(iterator, context):
    async for message in iterator:
        if isinstance(message, Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message.message)
        yield message


def _guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    kind = (handler.request_streaming, handler.response_streaming)
    behavior, factory = {
        (False, False): (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        (False, True): (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (True, False): (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (True, True): (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    }[kind]

    def arguments(request, context):
        if handler.request_streaming:
            return _checked(request, context)
        return request

    if inspect.isasyncgenfunction(behavior):

        async def guarded_gen(request, context):
            if isinstance(request, Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            async for response in behavior(arguments(request, context), context):
                yield response

        guarded = guarded_gen
    else:

        async def guarded_call(request, context):
            if isinstance(request, Unparsable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
            result = behavior(arguments(request, context), context)
            if inspect.isawaitable(result):
                result = await result
            return result

        guarded = guarded_call
    return factory(
        guarded,
        request_deserializer=safe_deserializer(handler.request_deserializer),
        response_serializer=handler.response_serializer,
    )


class ParseGuardInterceptor(grpc.aio.ServerInterceptor):
    """See the module docstring. Place it last, so outer interceptors (metrics) see the status it sets."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _guard(handler)
