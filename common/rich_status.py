"""``MmcastError`` → a gRPC status with ``google.rpc`` details (gRPC's rich error model, via ``grpcio-status``).

The one place that decides which details an error carries (docs/ERRORS.md is the contract clients rely on):
- ``BadRequest``: one field violation per path in ``err.fields`` (description: the error's message), on every
  error about a request field — each ``INVALID_ARGUMENT``, and a ``RESOURCE_EXHAUSTED`` where one field is over a
  size limit;
- ``RetryInfo``: on every ``UNAVAILABLE`` (``err.retry_after``, else ``UNAVAILABLE_RETRY_SECONDS``) and on a
  ``RESOURCE_EXHAUSTED`` caused by load (``err.retry_after`` set); never on a limit the request itself exceeds;
- ``ResourceInfo``: ``err.resource`` (the uploaded image a ``NOT_FOUND`` names, the request id an
  ``ALREADY_EXISTS`` names).
The status code and message are those of the plain status, unchanged: clients that ignore details lose nothing.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from common.errors import MmcastError, Status

# The retry hint of an UNAVAILABLE whose raiser knows no better delay (draining for shutdown, a request failed
# with the worker group): about the time a load balancer takes to route around a replica that went away.
UNAVAILABLE_RETRY_SECONDS = 1.0
# A computed delay (the group's next reconnect attempt) is never hinted below this: a client retrying sooner
# than a scheduler step would find the same state.
MIN_RETRY_SECONDS = 0.1


def grpc_code(err: MmcastError) -> grpc.StatusCode:
    return grpc.StatusCode[err.status.value]


def retry_delay(err: MmcastError) -> float | None:
    """Seconds the client should wait before sending the same request again; None: a retry cannot succeed."""
    if err.retry_after is not None:
        return max(MIN_RETRY_SECONDS, float(err.retry_after))
    if err.status is Status.UNAVAILABLE:
        return UNAVAILABLE_RETRY_SECONDS
    return None


def _duration(seconds: float) -> duration_pb2.Duration:
    whole = int(seconds)
    return duration_pb2.Duration(seconds=whole, nanos=int(round((seconds - whole) * 1e9)))


def _pack(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def status_proto(err: MmcastError) -> status_pb2.Status:
    """The ``google.rpc.Status`` of ``err``: its code, its message, and the details it calls for."""
    details = []
    if err.fields:
        details.append(
            _pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=path, description=err.message)
                        for path in err.fields
                    ]
                )
            )
        )
    delay = retry_delay(err)
    if delay is not None:
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=_duration(delay))))
    if err.resource is not None:
        details.append(
            _pack(
                error_details_pb2.ResourceInfo(
                    resource_type=err.resource.type,
                    resource_name=err.resource.name,
                    description=err.message,
                )
            )
        )
    return status_pb2.Status(code=grpc_code(err).value[0], message=err.message, details=details)


def to_grpc_status(err: MmcastError) -> grpc.Status:
    """What ``context.abort_with_status`` takes: code, message, and the details in ``grpc-status-details-bin``."""
    return rpc_status.to_status(status_proto(err))


async def abort(context: grpc.aio.ServicerContext, err: MmcastError) -> None:
    """Ends the RPC with ``err``'s status and details (raises, as ``context.abort`` does)."""
    await context.abort_with_status(to_grpc_status(err))
