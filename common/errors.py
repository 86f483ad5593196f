"""Errors that carry the status a client should see, independent of gRPC.

Decision code (frontend, scheduler core) raises these; servicers map ``status`` to ``grpc.StatusCode`` by name.
Messages name the field, the value, the limit and, where one exists, the flag that moves the limit.
"""

from __future__ import annotations

import enum


class Status(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAVAILABLE = "UNAVAILABLE"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"


class MmcastError(Exception):
    """An error with a client-facing status."""

    status = Status.INTERNAL

    def __init__(self, message: str, status: Status | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status

    @property
    def message(self) -> str:
        return str(self.args[0])


class InvalidArgument(MmcastError):
    status = Status.INVALID_ARGUMENT


class NotFound(MmcastError):
    status = Status.NOT_FOUND


class AlreadyExists(MmcastError):
    status = Status.ALREADY_EXISTS


class ResourceExhausted(MmcastError):
    status = Status.RESOURCE_EXHAUSTED


class Unavailable(MmcastError):
    status = Status.UNAVAILABLE


class FailedPrecondition(MmcastError):
    status = Status.FAILED_PRECONDITION
