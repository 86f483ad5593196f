"""The rank's payload and encoder-output caches, and the assembly of payload frames into tensors.

Contract with the scheduler (which mirrors both caches per rank): entries are keyed by item identifier and leave
**only** when a step says so (``evict_payload_ids``, ``evict_encoder_ids``, ``reset_caches``) or when the stream's
state is dropped. A budget overrun is therefore the scheduler's accounting error and is refused, not papered
over by evicting something the scheduler believes is still here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common import codec
from common.ids import ItemId
from mmcast.v1 import worker_pb2


class FrameError(ValueError):
    """A payload frame sequence that cannot be assembled; the message names the item, field and sizes."""


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class PayloadAssembler:
    """Turns the payload frames of one stream into complete ``{identifier: {field: tensor}}`` entries.

    A field's frames come contiguously: the first carries the header (and maybe chunk 0), the rest the chunks
    in order. Completed fields wait in ``pending`` until the next control frame takes them.
    """

    def __init__(self, max_tensor_bytes: int, max_pending_bytes: int | None = None) -> None:
        self.max_tensor_bytes = max_tensor_bytes
        # Bytes one step's frames may hold before its control takes them (the payload-cache budget: more could
        # never be merged). Checked on each header, before its buffer is allocated.
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.pending: dict[ItemId, dict[str, torch.Tensor]] = {}
        self._current: codec.TensorAssembler | None = None
        self._current_key: tuple[str, str] = ("", "")

    @property
    def in_progress(self) -> str | None:
        """Description of a field whose chunks are still missing, if any."""
        if self._current is None:
            return None
        ident, name = self._current_key
        return f"item {ident[:16]} field {name}"

    def add(self, frame: worker_pb2.PayloadFrame) -> None:
        key = (frame.item_identifier, frame.field_name)
        where = f"payload[{frame.item_identifier[:16]}].{frame.field_name}"
        if not frame.item_identifier or not frame.field_name:
            raise FrameError(f"{where}: item_identifier and field_name must both be set")
        try:
            if frame.HasField("header"):
                if self._current is not None:
                    raise FrameError(
                        f"{where}: a new tensor header arrived while {self.in_progress} still misses chunks "
                        f"({self._current.num_chunks} announced)"
                    )
                assembler = codec.TensorAssembler(frame.header, max_bytes=self.max_tensor_bytes, name=where)
                limit = self.max_pending_bytes
                if limit is not None and self.pending_bytes + assembler.byte_size > limit:
                    raise FrameError(
                        f"{where}: {assembler.byte_size} more bytes would make this step's payload frames hold "
                        f"{self.pending_bytes + assembler.byte_size}, over the payload cache budget of {limit} bytes "
                        "(--payload-cache-bytes)"
                    )
                self._current = assembler
                self._current_key = key
            elif self._current is None or key != self._current_key:
                raise FrameError(f"{where}: chunk without a preceding header for this item and field")
            if frame.HasField("chunk"):
                self._current.add_chunk(frame.chunk.index, frame.chunk.data)
            if self._current.complete:
                self.pending.setdefault(ItemId(frame.item_identifier), {})[frame.field_name] = self._current.tensor()
                self.pending_bytes += self._current.byte_size
                self._current = None
        except codec.TensorDecodeError as exc:
            self._current = None
            raise FrameError(str(exc)) from None

    def take(self) -> dict[ItemId, dict[str, torch.Tensor]]:
        """The completed entries so far; raises when a field is still incomplete (a control frame cut it)."""
        if self._current is not None:
            received = self._current._received
            raise FrameError(
                f"{self.in_progress}: the step control arrived after {received} of {self._current.num_chunks} "
                "chunks (missing chunks)"
            )
        pending, self.pending = self.pending, {}
        self.pending_bytes = 0
        return pending

    def clear(self) -> None:
        self.pending = {}
        self.pending_bytes = 0
        self._current = None


class PayloadCache:
    """Received payload tensors by item identifier, within a byte budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.entries: dict[ItemId, dict[str, torch.Tensor]] = {}
        self.nbytes = 0

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, identifier: str) -> dict[str, torch.Tensor] | None:
        return self.entries.get(identifier)  # type: ignore[arg-type]

    @staticmethod
    def entry_nbytes(fields: dict[str, torch.Tensor]) -> int:
        return sum(tensor_nbytes(t) for t in fields.values())

    def bytes_after(self, evict: Iterable[str], incoming: dict[ItemId, dict[str, torch.Tensor]], reset: bool) -> int:
        """Bytes held after evicting ``evict`` (or everything) and merging ``incoming``."""
        gone = set(evict)
        total = 0 if reset else self.nbytes - sum(self.entry_nbytes(self.entries[k]) for k in gone if k in self.entries)
        for ident, fields in incoming.items():
            old = {} if reset or ident in gone else self.entries.get(ident, {})
            total += sum(tensor_nbytes(t) - (tensor_nbytes(old[n]) if n in old else 0) for n, t in fields.items())
        return total

    def evict(self, identifiers: Iterable[str]) -> None:
        for ident in identifiers:
            fields = self.entries.pop(ident, None)  # type: ignore[arg-type]
            if fields is not None:
                self.nbytes -= self.entry_nbytes(fields)

    def merge(self, incoming: dict[ItemId, dict[str, torch.Tensor]]) -> None:
        """Adds (or replaces) fields of items; a field received again replaces the old tensor."""
        for ident, fields in incoming.items():
            entry = self.entries.setdefault(ident, {})
            self.nbytes -= self.entry_nbytes(entry)
            entry.update(fields)
            self.nbytes += self.entry_nbytes(entry)

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0


class EncoderCache:
    """Encoder outputs (``[rows, hidden]``) by item identifier, within a budget of rows."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.entries: dict[ItemId, torch.Tensor] = {}
        self.tokens = 0

    def __contains__(self, identifier: str) -> bool:
        return identifier in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, identifier: str) -> torch.Tensor | None:
        return self.entries.get(identifier)  # type: ignore[arg-type]

    def put(self, identifier: ItemId, rows: torch.Tensor) -> None:
        self.evict([identifier])
        self.entries[identifier] = rows
        self.tokens += rows.shape[0]

    def evict(self, identifiers: Iterable[str]) -> None:
        for ident in identifiers:
            rows = self.entries.pop(ident, None)  # type: ignore[arg-type]
            if rows is not None:
                self.tokens -= rows.shape[0]

    def clear(self) -> None:
        self.entries.clear()
        self.tokens = 0
