"""Errors that carry the status a client should see, independent of gRPC.

Decision code (frontend, scheduler core) raises these; servicers map ``status`` to ``grpc.StatusCode`` by name.
Messages name the field, the value, the limit and, where one exists, the flag that moves the limit.

Besides the message, an error may carry what a client program acts on (``common/rich_status.py`` turns them into
``google.rpc`` details; docs/ERRORS.md is the contract):
- ``fields``: the request field paths at fault (``messages[0].content[1].image``, ``sampling.temperature``) →
  ``BadRequest``. Set on every error about a request field, whatever its status.
- ``retry_after``: seconds after which the same request may succeed → ``RetryInfo``. Set only where the cause is
  load or an outage that passes; a limit the request itself exceeds leaves it ``None`` (a retry cannot succeed).
- ``resource``: the missing or conflicting resource → ``ResourceInfo``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

# The retry hint of a refusal caused by load that clears on its own (a full waiting queue, full upload buffers):
# about one request's queueing time on a busy server, short enough that a client is not idle for long.
RETRY_LATER_SECONDS = 1.0


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
    ABORTED = "ABORTED"  # a concurrency conflict (a live session's turn while another is in flight)
    OUT_OF_RANGE = "OUT_OF_RANGE"  # past the end of a valid range (a live session's positions)


@dataclasses.dataclass(frozen=True)
class Resource:
    """A resource an error is about (``google.rpc.ResourceInfo``)."""

    type: str  # "mmcast.v1/image" (an upload, by sha256), "mmcast.v1/request" (an in-flight request id)
    name: str  # its name within the type: the sha256 hex, the request id


IMAGE_RESOURCE = "mmcast.v1/image"
REQUEST_RESOURCE = "mmcast.v1/request"


class MmcastError(Exception):
    """An error with a client-facing status, and optionally the field, retry delay or resource it is about."""

    status = Status.INTERNAL

    def __init__(
        self,
        message: str,
        status: Status | None = None,
        *,
        field: str | Sequence[str] | None = None,
        retry_after: float | None = None,
        resource: Resource | None = None,
    ) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.fields: tuple[str, ...] = (field,) if isinstance(field, str) else tuple(field or ())
        self.retry_after = retry_after  # seconds >= 0, or None: a retry of the same request would fail again
        self.resource = resource

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


class Aborted(MmcastError):
    status = Status.ABORTED


class OutOfRange(MmcastError):
    status = Status.OUT_OF_RANGE
