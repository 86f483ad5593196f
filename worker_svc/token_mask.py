"""Structured output on the rank: the step's token masks (``StepControl.token_masks``), checked against the step's
windows and turned into the allowed-token rows that rank 0's sampler draws under (docs/ARCHITECTURE.md §2.12).

The scheduler owns each request's grammar and sends, per step, only the mask of the next token; a rank keeps
nothing of it between steps, so preemption and recovery need nothing here. A step the scheduler wrote before the
previous step's tokens were known announces its constrained requests in ``masks_follow``; their masks come in a
``LateTokenMasks`` frame while the step runs (``worker_svc/late_masks.py``).
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from common.ids import RequestId
from mmcast.v1 import worker_pb2
from worker_svc.step_errors import StepError, code


def mask_nbytes(vocab_size: int) -> int:
    """Bytes of one mask: ceil(vocab / 32) little-endian 32-bit words, as the grammar engine writes them."""
    return (vocab_size + 31) // 32 * 4


def _sampled_ids(windows: list, new_tokens: dict[RequestId, int] | None) -> set[RequestId]:
    """The requests a step samples: their window reaches their known tokens' end, counting the ``new_tokens`` their
    delta brings."""
    new_tokens = new_tokens or {}
    return {s.request_id for s, _a, end in windows if end == len(s.token_ids) + new_tokens.get(s.request_id, 0)}


def check_token_masks(
    control: worker_pb2.StepControl, windows: list, vocab_size: int, new_tokens: dict[RequestId, int] | None = None
) -> dict[RequestId, worker_pb2.TokenMask]:
    """Each mask names a request this step samples (its window reaches its known tokens' end, counting the
    ``new_tokens`` its delta brings), at most once, and has exactly ``mask_nbytes(vocab_size)`` bytes."""
    sampling = _sampled_ids(windows, new_tokens)
    return _checked_masks(control.token_masks, "token_masks", sampling, "is not sampled by this step", vocab_size)


def check_masks_follow(
    control: worker_pb2.StepControl, windows: list, new_tokens: dict[RequestId, int] | None = None
) -> frozenset[RequestId]:
    """Each id of ``masks_follow`` (masks that come later, in a ``LateTokenMasks`` frame) names a request the step
    samples, at most once, and none that has a mask in ``token_masks``. Returns the announced ids."""
    sampling = _sampled_ids(windows, new_tokens)
    in_control = {m.request_id for m in control.token_masks}
    follow: set[RequestId] = set()
    for k, raw in enumerate(control.masks_follow):
        rid, where = RequestId(raw), f"masks_follow[{k}]"
        if rid not in sampling:
            raise StepError(code.STATE_MISMATCH, f"{where}: request {rid} is not sampled by this step", rid)
        if rid in follow or rid in in_control:
            what = "twice in masks_follow" if rid in follow else "in masks_follow and in token_masks"
            raise StepError(code.STATE_MISMATCH, f"{where}: request {rid} is {what}", rid)
        follow.add(rid)
    return frozenset(follow)


def check_late_masks(
    frame: worker_pb2.LateTokenMasks, step_id: int, announced: frozenset[RequestId], vocab_size: int
) -> dict[RequestId, worker_pb2.TokenMask]:
    """A ``LateTokenMasks`` frame against the step waiting for it: the same step id, masks only for requests its
    control announced in ``masks_follow``, each at most once and of ``mask_nbytes(vocab_size)`` bytes. An announced
    request without a mask ended in the previous step (the scheduler drops its token): it draws unmasked."""
    if frame.step_id != step_id:
        raise StepError(
            code.STATE_MISMATCH,
            f"late_token_masks.step_id={frame.step_id}: the step waiting for its late masks is {step_id}",
        )
    where = "late_token_masks.masks"
    return _checked_masks(frame.masks, where, announced, f"is not in step {step_id}'s masks_follow", vocab_size)


def _checked_masks(masks, field: str, allowed_ids, not_allowed: str, vocab_size: int) -> dict:
    """``masks`` (TokenMask messages of ``field``): each for a request in ``allowed_ids``, once, of the right size."""
    want = mask_nbytes(vocab_size)
    out: dict[RequestId, worker_pb2.TokenMask] = {}
    for k, m in enumerate(masks):
        rid = RequestId(m.request_id)
        where = f"{field}[{k}]"
        if rid not in allowed_ids:
            raise StepError(code.STATE_MISMATCH, f"{where}: request {rid} {not_allowed}", rid)
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
    return _unpacked(masks, vocab_size, complement=False)


def forbidden_rows(masks: list[bytes], vocab_size: int) -> torch.Tensor:
    """The boolean ``[len(masks), vocab]`` rows of a step's masks with True where a token may NOT be sampled: the
    form the sampler's ``masked_fill_`` takes, unpacked from the bytes' complement in one call."""
    return _unpacked(masks, vocab_size, complement=True)


def _unpacked(masks: list[bytes], vocab_size: int, complement: bool) -> torch.Tensor:
    packed = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(len(masks), -1)
    if complement:
        packed = np.invert(packed)
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_))


class UnpackedMasks:
    """Rank 0's masks unpacked lately (``forbidden_rows``), by their bytes, least recently used dropped past
    ``max_bytes`` of rows. A grammar's masks repeat: every letter of a ``[a-z]+`` run, every character inside a JSON
    string, the whitespace between fields allow the same tokens, step after step. Timed in a served rank (2-vCPU VM,
    the tiny model), a step's mask took 37 µs to unpack and 5 µs when it was a repeat. The rows handed out are
    shared: callers only read them."""

    def __init__(self, max_bytes: int = 8 << 20) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._rows: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()  # mask -> [1, vocab]

    def __len__(self) -> int:
        return len(self._rows)

    def forbidden(self, masks: list[bytes], vocab_size: int) -> torch.Tensor:
        """``forbidden_rows(masks, vocab_size)``, each row unpacked at most once while it stays kept."""
        rows = []
        for mask in masks:
            row = self._rows.get(mask)
            if row is None:
                row = forbidden_rows([mask], vocab_size)
                self._keep(mask, row)
            else:
                self._rows.move_to_end(mask)
            rows.append(row)
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _keep(self, mask: bytes, row: torch.Tensor) -> None:
        size = row.numel() + len(mask)
        if size > self.max_bytes:
            return
        self._rows[mask] = row
        self.nbytes += size
        while self.nbytes > self.max_bytes:
            old, dropped = self._rows.popitem(last=False)
            self.nbytes -= dropped.numel() + len(old)
