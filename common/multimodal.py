"""The multimodal data model shared by the scheduler and the workers, and prefix-cache-aware stripping.

An item (one image) is a ``MultiModalFeatureSpec``: where its placeholder tokens sit in the prompt, its content
identifier, and its processor outputs as named fields. Fields flagged ``keep_on_cpu`` are small metadata
(``image_grid_thw``) that M-RoPE position computation needs for every item of the prompt; the other fields are
the heavy payload (``pixel_values``) that only the vision encoder consumes.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from common.ids import ItemId


class FieldKind(enum.Enum):
    """How a field's tensor relates to the batch (mirrors ``mmcast.v1.FieldKind``)."""

    BATCHED = "batched"  # one row per item along dim 0, e.g. image_grid_thw (1, 3)
    FLAT = "flat"  # a variable-length slice of a flat tensor, e.g. pixel_values (patches, dim)
    SHARED = "shared"  # the same value for every item of a batch


class PayloadState(enum.Enum):
    """Where an item's heavy fields are for one receiver (mirrors ``mmcast.v1.PayloadState``)."""

    PRESENT = "present"  # every field is here
    STRIPPED = "stripped"  # prefix-covered: only keep_on_cpu fields remain (or none)
    DEFERRED = "deferred"  # lazy transfer: the payload arrives in the step that schedules its encoder work
    RANK_CACHED = "rank_cached"  # the receiver already holds the payload or its encoder output


class PayloadEncoding(enum.Enum):
    """What an item's payload fields hold (mirrors ``mmcast.v1.PayloadEncoding``)."""

    PIXELS = "pixels"  # the processor's outputs (pixel_values)
    ENCODED = "encoded"  # the image file as the client sent it (ENCODED_FIELD); the encoding rank preprocesses it


ENCODED_FIELD = "image_bytes"  # the payload field of an ENCODED image: the file's bytes as a 1-D uint8 tensor
VIDEO_ENCODED_FIELD = "video_bytes"  # ... of an ENCODED video: the container file's bytes, 1-D uint8
FRAME_INDICES_FIELD = "video_frame_indices"  # ... and the frames its owner decodes, 1-D int64 (the sampling plan)


class Modality(enum.Enum):
    IMAGE = "image"
    VIDEO = "video"


@dataclasses.dataclass(frozen=True)
class PlaceholderRange:
    """Placeholder tokens of an item: prompt positions ``[offset, offset + length)``."""

    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens
    is_embed: Any = None  # optional bool mask of ``length`` entries: which tokens take an embedding

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 0:
            raise ValueError(f"PlaceholderRange offset={self.offset}, length={self.length}: both must be >= 0")
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(f"PlaceholderRange.is_embed has {len(self.is_embed)} entries, length is {self.length}")

    @property
    def end(self) -> int:
        """First prompt position after the item."""
        return self.offset + self.length

    def get_num_embeds(self) -> int:
        """Encoder output rows this item contributes."""
        if self.is_embed is None:
            return self.length
        return int(sum(bool(x) for x in self.is_embed))


@dataclasses.dataclass(frozen=True)
class MultiModalFieldElem:
    """One processor output of one item."""

    data: Any  # a torch.Tensor (CPU); never mutated once built
    keep_on_cpu: bool = False  # small metadata needed for positions; survives stripping for M-RoPE models
    kind: FieldKind = FieldKind.BATCHED


class MultiModalKwargsItem(Mapping[str, MultiModalFieldElem]):
    """An item's fields by name (``pixel_values``, ``image_grid_thw``, ...). Immutable."""

    __slots__ = ("_fields",)

    def __init__(self, fields: Mapping[str, MultiModalFieldElem]) -> None:
        self._fields = dict(fields)

    def __getitem__(self, key: str) -> MultiModalFieldElem:
        return self._fields[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def __len__(self) -> int:
        return len(self._fields)

    def __repr__(self) -> str:
        return f"MultiModalKwargsItem({sorted(self._fields)})"

    def only_keep_on_cpu(self) -> MultiModalKwargsItem:
        """The same item reduced to its keep_on_cpu fields (the tensors are shared, not copied)."""
        return MultiModalKwargsItem({k: v for k, v in self._fields.items() if v.keep_on_cpu})

    def payload_fields(self) -> dict[str, MultiModalFieldElem]:
        """The heavy fields: everything not flagged keep_on_cpu."""
        return {k: v for k, v in self._fields.items() if not v.keep_on_cpu}

    def payload_nbytes(self) -> int:
        """Bytes of the heavy fields' tensors."""
        return sum(_nbytes(v.data) for v in self.payload_fields().values())

    def nbytes(self) -> int:
        return sum(_nbytes(v.data) for v in self._fields.values())


def _nbytes(data: Any) -> int:
    if hasattr(data, "nbytes"):
        return int(data.nbytes)
    if hasattr(data, "element_size"):
        return int(data.element_size() * data.numel())
    return 0


@dataclasses.dataclass(frozen=True)
class MultiModalFeatureSpec:
    """One multimodal item of a request.

    Invariants: ``identifier`` depends only on the encoded content and the processor settings; ``data`` is None
    exactly when the payload state says nothing travels (STRIPPED without M-RoPE metadata).
    """

    data: MultiModalKwargsItem | None  # the fields that are present for this holder
    modality: Modality
    identifier: ItemId
    mm_position: PlaceholderRange
    payload_state: PayloadState = PayloadState.PRESENT
    payload_nbytes: int = 0  # bytes of the heavy fields in the original item (kept when they are stripped)
    encoding: PayloadEncoding = PayloadEncoding.PIXELS

    def covered_by(self, num_computed_tokens: int) -> bool:
        """True when the item's whole placeholder span lies inside the computed prefix (equality counts)."""
        return self.mm_position.end <= num_computed_tokens

    def overlaps(self, start: int, end: int) -> bool:
        """True when the placeholder span intersects the token window ``[start, end)``."""
        return self.mm_position.offset < end and start < self.mm_position.end

    def shifted(self, by: int) -> MultiModalFeatureSpec:
        """The same item with its placeholder ``by`` tokens later (a live turn's tokens placed after the session's)."""
        if not by:
            return self
        pos = self.mm_position
        return dataclasses.replace(self, mm_position=dataclasses.replace(pos, offset=pos.offset + by))


def strip_covered_mm_data(
    mm_features: Sequence[MultiModalFeatureSpec] | None,
    num_computed_tokens: int,
    uses_mrope: bool = False,
) -> Sequence[MultiModalFeatureSpec] | None:
    """A copy of ``mm_features`` for the wire, with the payload of every prefix-covered item dropped.

    - An item is covered iff ``offset + length <= num_computed_tokens``; it then gets ``payload_state=STRIPPED``.
    - ``uses_mrope`` (any model whose positions need item metadata): a stripped item keeps exactly its
      ``keep_on_cpu`` fields; otherwise its data becomes None.
    - Items already without data stay so; identifier, modality and position never change.
    - With no features, or ``num_computed_tokens == 0``, the same object comes back; inputs are never mutated.
    """
    if not mm_features or num_computed_tokens <= 0:
        return mm_features
    out: list[MultiModalFeatureSpec] | None = None
    for i, feature in enumerate(mm_features):
        if not feature.covered_by(num_computed_tokens) or feature.payload_state is PayloadState.STRIPPED:
            continue  # uncovered items travel as they are; stripped ones are already minimal
        if feature.data is None:
            kept = None
        elif uses_mrope:
            kept = feature.data.only_keep_on_cpu()
        else:
            kept = None
        if out is None:
            out = list(mm_features)
        payload_nbytes = feature.payload_nbytes or (feature.data.payload_nbytes() if feature.data else 0)
        out[i] = dataclasses.replace(
            feature, data=kept, payload_state=PayloadState.STRIPPED, payload_nbytes=payload_nbytes
        )
    return mm_features if out is None else out
