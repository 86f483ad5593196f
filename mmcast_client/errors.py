"""Typed SDK exceptions: one class per gRPC status, each carrying the status code and the server's message.

Catch `MmcastError` for everything, or a subclass (`NotFound`, `ResourceExhausted`, ...) for one status. Errors the
SDK finds itself before sending anything (a malformed message, an unreadable image) are `InvalidArgument`, which is
also a `ValueError`.

A stream that fails after producing output is never retried (a retry would repeat it): its error, typically
`Unavailable` when the replica serving it died, carries what arrived before the failure in `token_ids`, `text` and
`logprobs`, so the caller can show it or continue from it.

The server's google.rpc error details (gRPC's rich error model) are parsed onto every exception:
`field_violations` (google.rpc.BadRequest: which request field is wrong, e.g. `messages[0].content[1].image`),
`retry_delay` (google.rpc.RetryInfo: seconds the server asks to wait before trying again) and `resource_info`
(google.rpc.ResourceInfo: the resource concerned, e.g. an image by its sha256).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


class FieldViolation(NamedTuple):
    """One google.rpc.BadRequest.FieldViolation: the request field (a path such as `messages[0].content[1].image`)
    and what is wrong with it."""

    field: str
    description: str


class ResourceInfo(NamedTuple):
    """google.rpc.ResourceInfo: the resource an error concerns (e.g. `resource_type="image"`, `resource_name`
    its sha256)."""

    resource_type: str
    resource_name: str
    description: str


class MmcastError(Exception):
    """A failed call: `code` is the gRPC status, `message` the server's (or the SDK's) explanation."""

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(self, code: grpc.StatusCode | None = None, message: str = "") -> None:
        self.code = code if code is not None else self.default_code
        self.message = message
        self.token_ids: tuple[int, ...] = ()  # tokens the stream delivered before it failed (empty when none)
        self.text: str = ""  # their text, as the deltas carried it
        self.logprobs: tuple = ()  # their TokenLogprobs, when logprobs were asked for
        self.field_violations: list[FieldViolation] = []  # google.rpc.BadRequest, in the server's order
        self.retry_delay: float | None = None  # google.rpc.RetryInfo: seconds to wait before a retry; None: no advice
        self.resource_info: ResourceInfo | None = None  # google.rpc.ResourceInfo: the resource concerned
        super().__init__(f"{self.code.name}: {message}")


class InvalidArgument(MmcastError, ValueError):
    default_code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(MmcastError):
    default_code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MmcastError):
    default_code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(MmcastError):
    default_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(MmcastError):
    default_code = grpc.StatusCode.FAILED_PRECONDITION


class Unavailable(MmcastError):
    default_code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(MmcastError, TimeoutError):
    default_code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(MmcastError):
    default_code = grpc.StatusCode.CANCELLED


class Internal(MmcastError):
    default_code = grpc.StatusCode.INTERNAL


class Unauthenticated(MmcastError):
    default_code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MmcastError):
    default_code = grpc.StatusCode.PERMISSION_DENIED


class Unimplemented(MmcastError):
    default_code = grpc.StatusCode.UNIMPLEMENTED


_BY_CODE: dict[grpc.StatusCode, type[MmcastError]] = {
    cls.default_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        ResourceExhausted,
        FailedPrecondition,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
        Unauthenticated,
        PermissionDenied,
        Unimplemented,
    )
}
_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def error_for(code: grpc.StatusCode, message: str) -> MmcastError:
    """The typed exception for `code` (plain `MmcastError` for statuses without a class of their own)."""
    return _BY_CODE.get(code, MmcastError)(code, message)


def from_rpc_error(error: grpc.RpcError) -> MmcastError:
    """Translates a gRPC error (sync or asyncio) into the typed exception with the server's message and the
    google.rpc details it carried."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    result = error_for(code or grpc.StatusCode.UNKNOWN, details or "")
    add_details(result, _rich_details(error))
    return result


def _rich_details(error: Any) -> list[Any]:
    """The google.protobuf.Any details of the status in the error's `grpc-status-details-bin` trailer ([] without
    one, or when it contradicts the call's code and message: gRPC's own checks, which then raise ValueError)."""
    if not hasattr(error, "trailing_metadata"):
        return []
    try:
        status = rpc_status.from_call(error)
    except ValueError:
        return []
    return list(status.details) if status is not None else []


def add_details(error: MmcastError, details: list[Any]) -> None:
    """Unpacks the google.rpc detail messages the SDK knows onto `error`; others are ignored."""
    for any_msg in details:
        if any_msg.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            any_msg.Unpack(bad)
            error.field_violations.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
        elif any_msg.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            any_msg.Unpack(info)
            error.retry_delay = info.retry_delay.ToTimedelta().total_seconds()
        elif any_msg.Is(error_details_pb2.ResourceInfo.DESCRIPTOR):
            res = error_details_pb2.ResourceInfo()
            any_msg.Unpack(res)
            error.resource_info = ResourceInfo(res.resource_type, res.resource_name, res.description)


def from_google_rpc_code(value: int, message: str) -> MmcastError:
    """For `GenerateError.grpc_code`, a google.rpc.Code number."""
    return error_for(_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), message)
