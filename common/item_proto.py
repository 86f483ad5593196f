"""Conversions between the multimodal dataclasses and their protobuf messages, and the byte accounting that
both ends of the step stream share.

Contract: an item's ``keep_on_cpu`` fields travel inline in its metadata; its payload fields travel as a
header only (dtype, shape, byte size) and their data as ``PayloadFrame``s (``common.codec.payload_frames``).
Every payload state survives the round trip.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from common import codec
from common.ids import ItemId
from common.multimodal import (
    FieldKind,
    Modality,
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PayloadEncoding,
    PayloadState,
    PlaceholderRange,
)
from mmcast.v1 import multimodal_pb2, worker_pb2

PROTOCOL_VERSION = worker_pb2.PROTOCOL_VERSION_1
MAX_METADATA_TENSOR_BYTES = 1 << 16  # inline (keep_on_cpu) tensors are small; anything larger is refused

_STATE_TO_PROTO = {
    PayloadState.PRESENT: multimodal_pb2.PAYLOAD_STATE_PRESENT,
    PayloadState.STRIPPED: multimodal_pb2.PAYLOAD_STATE_STRIPPED,
    PayloadState.DEFERRED: multimodal_pb2.PAYLOAD_STATE_DEFERRED,
    PayloadState.RANK_CACHED: multimodal_pb2.PAYLOAD_STATE_RANK_CACHED,
}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}
_KIND_TO_PROTO = {
    FieldKind.BATCHED: multimodal_pb2.FIELD_KIND_BATCHED,
    FieldKind.FLAT: multimodal_pb2.FIELD_KIND_FLAT,
    FieldKind.SHARED: multimodal_pb2.FIELD_KIND_SHARED,
}
_KIND_FROM_PROTO = {v: k for k, v in _KIND_TO_PROTO.items()}
_MODALITY_TO_PROTO = {Modality.IMAGE: multimodal_pb2.MODALITY_IMAGE, Modality.VIDEO: multimodal_pb2.MODALITY_VIDEO}
_MODALITY_FROM_PROTO = {v: k for k, v in _MODALITY_TO_PROTO.items()}
_ENCODING_TO_PROTO = {
    PayloadEncoding.PIXELS: multimodal_pb2.PAYLOAD_ENCODING_PIXELS,
    PayloadEncoding.ENCODED: multimodal_pb2.PAYLOAD_ENCODING_ENCODED,
}
_ENCODING_FROM_PROTO = {v: k for k, v in _ENCODING_TO_PROTO.items()}
_ENCODING_FROM_PROTO[multimodal_pb2.PAYLOAD_ENCODING_UNSPECIFIED] = PayloadEncoding.PIXELS


class WireError(ValueError):
    """A message that cannot be converted; the text names the field and what was wrong."""


def feature_to_proto(
    feature: MultiModalFeatureSpec, payload_state: PayloadState | None = None
) -> multimodal_pb2.MultiModalItem:
    """Metadata of one item for the wire. ``payload_state`` overrides the feature's own state (the wire copy of
    a lazily sent item is DEFERRED while the scheduler's own copy stays PRESENT)."""
    state = payload_state or feature.payload_state
    pos = feature.mm_position
    msg = multimodal_pb2.MultiModalItem(
        identifier=feature.identifier,
        modality=_MODALITY_TO_PROTO[feature.modality],
        position=multimodal_pb2.PlaceholderRange(
            offset=pos.offset,
            length=pos.length,
            is_embed=[] if pos.is_embed is None else [bool(x) for x in pos.is_embed],
        ),
        payload_state=_STATE_TO_PROTO[state],
        encoding=_ENCODING_TO_PROTO[feature.encoding],
    )
    if feature.data is None:
        return msg
    for name, elem in feature.data.items():
        if state is PayloadState.STRIPPED and not elem.keep_on_cpu:
            continue  # a stripped item carries exactly its keep_on_cpu fields
        if elem.keep_on_cpu:
            header, _ = codec.encode_tensor(elem.data, inline=True)
        else:
            header, _ = codec.encode_tensor(elem.data, chunk_size=codec.MAX_CHUNK_SIZE)
            header.ClearField("num_chunks")
            header.ClearField("chunk_size")  # chunking is the payload frames' business
        msg.fields.add(name=name, kind=_KIND_TO_PROTO[elem.kind], keep_on_cpu=elem.keep_on_cpu, tensor=header)
    return msg


def payload_field_headers(msg: multimodal_pb2.MultiModalItem) -> dict[str, multimodal_pb2.MultiModalField]:
    """The payload (non keep_on_cpu) fields an item's metadata announces, by name."""
    return {f.name: f for f in msg.fields if not f.keep_on_cpu}


def feature_from_proto(
    msg: multimodal_pb2.MultiModalItem,
    payload: Mapping[str, torch.Tensor] | None = None,
    *,
    max_prompt_len: int | None = None,
) -> MultiModalFeatureSpec:
    """Item metadata (plus, optionally, its assembled payload tensors) → dataclass.

    Keep_on_cpu fields are decoded from their inline data; payload fields are filled from ``payload`` when
    given (their dtype and shape must match the announced headers), else left out of ``data``.
    """
    where = f"mm_item[{msg.identifier[:16]}]"
    if not msg.identifier:
        raise WireError("mm_item.identifier is empty")
    if msg.payload_state not in _STATE_FROM_PROTO:
        raise WireError(f"{where}.payload_state={msg.payload_state} is not a known state")
    if msg.modality not in _MODALITY_FROM_PROTO:
        raise WireError(f"{where}.modality={msg.modality} is not a known modality")
    if msg.encoding not in _ENCODING_FROM_PROTO:
        raise WireError(f"{where}.encoding={msg.encoding} is not a known payload encoding")
    pos = msg.position
    if max_prompt_len is not None and pos.offset + pos.length > max_prompt_len:
        raise WireError(
            f"{where}.position [{pos.offset}, {pos.offset + pos.length}) exceeds the prompt length {max_prompt_len}"
        )
    fields: dict[str, MultiModalFieldElem] = {}
    for f in msg.fields:
        if f.kind not in _KIND_FROM_PROTO:
            raise WireError(f"{where}.fields[{f.name}].kind={f.kind} is not a known field kind")
        if f.keep_on_cpu:
            try:
                data = codec.decode_tensor(f.tensor, max_bytes=MAX_METADATA_TENSOR_BYTES, name=f"{where}.{f.name}")
            except codec.TensorDecodeError as exc:
                raise WireError(str(exc)) from None
        elif payload is not None and f.name in payload:
            data = payload[f.name]
            check_payload_matches(f, data, where)
        else:
            continue
        fields[f.name] = MultiModalFieldElem(data=data, keep_on_cpu=f.keep_on_cpu, kind=_KIND_FROM_PROTO[f.kind])
    payload_nbytes = sum(f.tensor.byte_size for f in msg.fields if not f.keep_on_cpu)
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem(fields) if fields or msg.fields else None,
        modality=_MODALITY_FROM_PROTO[msg.modality],
        identifier=ItemId(msg.identifier),
        mm_position=PlaceholderRange(pos.offset, pos.length, list(pos.is_embed) if pos.is_embed else None),
        payload_state=_STATE_FROM_PROTO[msg.payload_state],
        payload_nbytes=payload_nbytes,
        encoding=_ENCODING_FROM_PROTO[msg.encoding],
    )


def check_payload_matches(field: multimodal_pb2.MultiModalField, tensor: torch.Tensor, where: str) -> None:
    """The received payload tensor must have the dtype and shape the item's metadata announces."""
    want_dtype = codec.dtype_from_proto(field.tensor.dtype, f"{where}.{field.name}")
    if tensor.dtype != want_dtype or tuple(tensor.shape) != tuple(field.tensor.shape):
        raise WireError(
            f"{where}.{field.name}: payload is {tensor.dtype}{tuple(tensor.shape)}, metadata announces "
            f"{want_dtype}{tuple(field.tensor.shape)}"
        )


def control_byte_breakdown(control: worker_pb2.StepControl, frame_size: int) -> tuple[int, int]:
    """(metadata bytes, control bytes) of a serialized control frame of ``frame_size`` bytes.

    Metadata is the serialized size of every item message in the new requests; control is the rest of the
    frame. Sender and receiver compute the same split from the same message, so their counters agree.
    """
    metadata = sum(item.ByteSize() for req in control.new_requests for item in req.mm_items)
    return metadata, frame_size - metadata
