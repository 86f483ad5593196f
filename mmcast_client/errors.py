"""Typed SDK exceptions: one class per gRPC status, each carrying the status code and the server's message.

Catch `MmcastError` for everything, or a subclass (`NotFound`, `ResourceExhausted`, ...) for one status. Errors the
SDK finds itself before sending anything (a malformed message, an unreadable image) are `InvalidArgument`, which is
also a `ValueError`.

A stream that fails after producing output is never retried (a retry would repeat it): its error, typically
`Unavailable` when the replica serving it died, carries what arrived before the failure in `token_ids`, `text` and
`logprobs`, so the caller can show it or continue from it.
"""

from __future__ import annotations

import grpc


class MmcastError(Exception):
    """A failed call: `code` is the gRPC status, `message` the server's (or the SDK's) explanation."""

    default_code = grpc.StatusCode.UNKNOWN

    def __init__(self, code: grpc.StatusCode | None = None, message: str = "") -> None:
        self.code = code if code is not None else self.default_code
        self.message = message
        self.token_ids: tuple[int, ...] = ()  # tokens the stream delivered before it failed (empty when none)
        self.text: str = ""  # their text, as the deltas carried it
        self.logprobs: tuple = ()  # their TokenLogprobs, when return_logprobs=True
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
    """Translates a gRPC error (sync or asyncio) into the typed exception with the server's message."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "")


def from_google_rpc_code(value: int, message: str) -> MmcastError:
    """For `GenerateError.grpc_code`, a google.rpc.Code number."""
    return error_for(_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN), message)
