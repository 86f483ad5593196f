"""The mmcast client SDK: sync `Client` and asyncio `AsyncClient` for the `mmcast.v1.GenerationService` service.

Needs only grpcio, grpcio-status, protobuf, Pillow and numpy (never torch or transformers), so applications can
import it cheaply. Typed (PEP 561): `generate(stream=False)` is a `Result`, `generate(stream=True)` a stream.
"""

from mmcast_client._core import (
    DEFAULT_FIRST_TOKEN_TIMEOUT,
    DEFAULT_TIMEOUT,
    NOT_GIVEN,
    InsecureTokenWarning,
    ServerInfo,
)
from mmcast_client.aio import AsyncClient, AsyncGenerationStream
from mmcast_client.client import Client, GenerationStream
from mmcast_client.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    FieldViolation,
    Internal,
    InvalidArgument,
    MmcastError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    ResourceInfo,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from mmcast_client.images import ImageStore
from mmcast_client.types import Backoff, Delta, Result, TokenLogprob, TopLogprob, Usage

__all__ = [
    "DEFAULT_FIRST_TOKEN_TIMEOUT",
    "DEFAULT_TIMEOUT",
    "NOT_GIVEN",
    "AlreadyExists",
    "AsyncClient",
    "AsyncGenerationStream",
    "Backoff",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "Delta",
    "FailedPrecondition",
    "FieldViolation",
    "GenerationStream",
    "ImageStore",
    "InsecureTokenWarning",
    "Internal",
    "InvalidArgument",
    "MmcastError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "ResourceInfo",
    "Result",
    "ServerInfo",
    "TokenLogprob",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Usage",
]
