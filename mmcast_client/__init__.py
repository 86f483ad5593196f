"""The mmcast client SDK: sync `Client` and asyncio `AsyncClient` for the `mmcast.v1.GenerationService` service.

Needs only grpcio, protobuf, Pillow and numpy (never torch or transformers), so applications can import it cheaply.
"""

from mmcast_client._core import ServerInfo
from mmcast_client.aio import AsyncClient, AsyncGenerationStream
from mmcast_client.client import Client, GenerationStream
from mmcast_client.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    MmcastError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Unimplemented,
)
from mmcast_client.types import Backoff, Delta, Result, TokenLogprob, TopLogprob, Usage

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "AsyncGenerationStream",
    "Backoff",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "Delta",
    "FailedPrecondition",
    "GenerationStream",
    "Internal",
    "InvalidArgument",
    "MmcastError",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Result",
    "ServerInfo",
    "TokenLogprob",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Unimplemented",
    "Usage",
]
