"""Structured output on the rank: the step's token masks (``StepControl.token_masks``), checked against the step's
windows and turned into the allowed-token rows that rank 0's sampler draws under (docs/ARCHITECTURE.md §2.12).

The scheduler owns each request's grammar and sends, per step, only the mask of the next token; a rank keeps
nothing of it between steps, so preemption and recovery need nothing here.
"""

from __future__ import annotations

import numpy as np
import torch

from common.ids import RequestId
from mmcast.v1 import worker_pb2
from worker_svc.step_errors import StepError, code


def mask_nbytes(vocab_size: int) -> int:
    """Bytes of one mask: ceil(vocab / 32) little-endian 32-bit words, as the grammar engine writes them."""
    return (vocab_size + 31) // 32 * 4


def check_token_masks(
    control: worker_pb2.StepControl, windows: list, vocab_size: int, new_tokens: dict[RequestId, int] | None = None
) -> dict[RequestId, worker_pb2.TokenMask]:
    """Each mask names a request this step samples (its window reaches its known tokens' end, counting the
    ``new_tokens`` its delta brings), at most once, and has exactly ``mask_nbytes(vocab_size)`` bytes."""
    new_tokens = new_tokens or {}
    sampling = {s.request_id for s, _a, end in windows if end == len(s.token_ids) + new_tokens.get(s.request_id, 0)}
    want = mask_nbytes(vocab_size)
    out: dict[RequestId, worker_pb2.TokenMask] = {}
    for k, m in enumerate(control.token_masks):
        rid = RequestId(m.request_id)
        where = f"token_masks[{k}]"
        if rid not in sampling:
            raise StepError(code.STATE_MISMATCH, f"{where}: request {rid} is not sampled by this step", rid)
        if rid in out:
            raise StepError(code.STATE_MISMATCH, f"{where}: a second mask for request {rid}", rid)
        if len(m.allowed) != want:
            raise StepError(
                code.OUT_OF_RANGE,
                f"{where}: {len(m.allowed)} bytes of allowed tokens, the vocabulary of {vocab_size} takes {want}",
                rid,
            )
        out[rid] = m
    return out


def allowed_tokens(mask: bytes, vocab_size: int) -> torch.Tensor:
    """The boolean ``[vocab]`` row of a mask: True = the token may be sampled."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.astype(np.bool_))


def allowed_rows(masks: list[bytes], vocab_size: int) -> torch.Tensor:
    """The boolean ``[len(masks), vocab]`` rows of a step's masks (each ``mask_nbytes(vocab_size)`` bytes, as
    ``check_token_masks`` ensures), unpacked in one call."""
    packed = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(masks), -1)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))
