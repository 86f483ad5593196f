"""The error a rank reports when it cannot apply a frame: a ``ProtocolError`` code and a message naming the field,
the value and the limit."""

from __future__ import annotations

import types

from mmcast.v1 import worker_pb2

code = types.SimpleNamespace(
    MISSING_PAYLOAD=worker_pb2.PROTOCOL_ERROR_CODE_MISSING_PAYLOAD,
    UNKNOWN_REQUEST=worker_pb2.PROTOCOL_ERROR_CODE_UNKNOWN_REQUEST,
    BAD_TENSOR=worker_pb2.PROTOCOL_ERROR_CODE_BAD_TENSOR,
    STATE_MISMATCH=worker_pb2.PROTOCOL_ERROR_CODE_STATE_MISMATCH,
    OUT_OF_RANGE=worker_pb2.PROTOCOL_ERROR_CODE_OUT_OF_RANGE,
    INTERNAL=worker_pb2.PROTOCOL_ERROR_CODE_INTERNAL,
)


def code_name(value: int) -> str:
    """``MISSING_PAYLOAD`` for ``PROTOCOL_ERROR_CODE_MISSING_PAYLOAD`` (metric label values)."""
    return worker_pb2.ProtocolErrorCode.Name(value).removeprefix("PROTOCOL_ERROR_CODE_")


class StepError(Exception):
    """A frame the rank refuses. Raised before any collective work for everything a rank can check alone."""

    def __init__(self, error_code: int, message: str, request_id: str = "", item_identifier: str = "") -> None:
        super().__init__(message)
        self.code = error_code
        self.message = message
        self.request_id = request_id
        self.item_identifier = item_identifier

    def to_proto(self, step_id: int, rank: int) -> worker_pb2.ProtocolError:
        return worker_pb2.ProtocolError(
            step_id=step_id,
            code=self.code,
            message=self.message,
            request_id=self.request_id,
            item_identifier=self.item_identifier,
            rank=rank,
        )
