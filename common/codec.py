"""The tensor codec: a tensor becomes a header plus ordered chunks, and chunks become a tensor again.

Sender: ``encode_tensor`` views the tensor's bytes without copying and slices them into ``chunk_size`` pieces;
``payload_frames`` turns one field of one item into ready-to-write ``StepRequest`` bytes, each chunk copied
exactly once (into its frame).

Receiver: ``TensorAssembler`` validates the header — known dtype, ``prod(shape) * itemsize == byte_size``, the
byte size within a limit, a chunk count consistent with the chunk size — before it allocates anything, then
copies each chunk once into one preallocated buffer and builds the tensor over that buffer
(``torch.frombuffer``), without a second copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from mmcast.v1 import tensor_pb2

DEFAULT_CHUNK_SIZE = 1 << 20  # 1 MiB: measured fastest over gRPC here (64 KiB is 2.5x slower, 4 MiB 10-30 %)
MAX_CHUNK_SIZE = 64 << 20  # a receiver refuses headers announcing larger chunks
MAX_NDIM = 16  # processor outputs have at most 5 dimensions; more is refused before any work

_TO_PROTO: dict[torch.dtype, int] = {
    torch.float32: tensor_pb2.DTYPE_FLOAT32,
    torch.bfloat16: tensor_pb2.DTYPE_BFLOAT16,
    torch.float16: tensor_pb2.DTYPE_FLOAT16,
    torch.int64: tensor_pb2.DTYPE_INT64,
    torch.int32: tensor_pb2.DTYPE_INT32,
    torch.uint8: tensor_pb2.DTYPE_UINT8,
    torch.bool: tensor_pb2.DTYPE_BOOL,
}
_FROM_PROTO: dict[int, torch.dtype] = {v: k for k, v in _TO_PROTO.items()}


class TensorDecodeError(ValueError):
    """A header or chunk sequence that cannot be a valid tensor. The message names the tensor and the sizes."""


def dtype_to_proto(dtype: torch.dtype) -> int:
    try:
        return _TO_PROTO[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot travel; supported: {sorted(str(d) for d in _TO_PROTO)}") from None


def dtype_from_proto(value: int, name: str = "tensor") -> torch.dtype:
    try:
        return _FROM_PROTO[value]
    except KeyError:
        raise TensorDecodeError(f"{name}: unknown dtype {value}; known: {sorted(_FROM_PROTO)}") from None


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes in row-major order, without a copy when it is already contiguous on the CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def encode_tensor(
    tensor: torch.Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE, inline: bool = False
) -> tuple[tensor_pb2.TensorHeader, list[memoryview]]:
    """Header and chunk views of ``tensor``. ``inline`` puts the data in the header (small metadata only)."""
    if chunk_size <= 0 or chunk_size > MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size={chunk_size} must be in [1, {MAX_CHUNK_SIZE}]")
    data = tensor_bytes(tensor)
    header = tensor_pb2.TensorHeader(dtype=dtype_to_proto(tensor.dtype), shape=list(tensor.shape), byte_size=len(data))
    if inline or len(data) == 0:
        header.inline_data = data.tobytes()
        return header, []
    header.chunk_size = chunk_size
    header.num_chunks = math.ceil(len(data) / chunk_size)
    return header, [data[i : i + chunk_size] for i in range(0, len(data), chunk_size)]


def expected_byte_size(header: tensor_pb2.TensorHeader, name: str = "tensor") -> int:
    """prod(shape) * itemsize, checking every dimension."""
    dtype = dtype_from_proto(header.dtype, name)
    if len(header.shape) > MAX_NDIM:
        raise TensorDecodeError(f"{name}: {len(header.shape)} dimensions; at most {MAX_NDIM} are accepted")
    numel = 1
    for dim in header.shape:
        if dim < 0:
            raise TensorDecodeError(f"{name}: negative dimension {dim} in shape {list(header.shape)}")
        numel *= dim
    itemsize = torch.empty((), dtype=dtype).element_size()
    return numel * itemsize


class TensorAssembler:
    """Rebuilds one tensor from its header and chunks; every check happens before memory is touched."""

    def __init__(self, header: tensor_pb2.TensorHeader, *, max_bytes: int, name: str = "tensor") -> None:
        self.name = name
        self.dtype = dtype_from_proto(header.dtype, name)
        self.shape = tuple(int(d) for d in header.shape)
        self.byte_size = int(header.byte_size)
        expected = expected_byte_size(header, name)
        if expected != self.byte_size:
            raise TensorDecodeError(
                f"{name}: header byte_size {self.byte_size} != {expected} implied by shape {list(self.shape)} "
                f"and dtype {self.dtype}"
            )
        if self.byte_size > max_bytes:
            raise TensorDecodeError(
                f"{name}: byte_size {self.byte_size} exceeds the limit of {max_bytes} bytes (max_tensor_bytes)"
            )
        # An empty tensor may not have giant other dimensions either: torch's strides would overflow.
        extent = math.prod(max(d, 1) for d in self.shape) * torch.empty((), dtype=self.dtype).element_size()
        if extent > max_bytes:
            raise TensorDecodeError(
                f"{name}: shape {list(self.shape)} spans {extent} bytes with its zero dimensions counted as 1, over "
                f"the limit of {max_bytes} bytes (max_tensor_bytes)"
            )
        self.num_chunks = int(header.num_chunks)
        self.chunk_size = int(header.chunk_size)
        if self.num_chunks == 0:
            if len(header.inline_data) != self.byte_size:
                raise TensorDecodeError(
                    f"{name}: inline data has {len(header.inline_data)} bytes, header says {self.byte_size}"
                )
            self._buf = bytearray(header.inline_data)
        else:
            if header.inline_data:
                raise TensorDecodeError(f"{name}: both inline data and {self.num_chunks} chunks announced")
            if not 0 < self.chunk_size <= MAX_CHUNK_SIZE:
                raise TensorDecodeError(f"{name}: chunk_size {self.chunk_size} not in [1, {MAX_CHUNK_SIZE}]")
            if self.num_chunks != math.ceil(self.byte_size / self.chunk_size):
                raise TensorDecodeError(
                    f"{name}: {self.num_chunks} chunks announced, {self.byte_size} bytes in chunks of "
                    f"{self.chunk_size} need {math.ceil(self.byte_size / self.chunk_size)}"
                )
            self._buf = bytearray(self.byte_size)
        self._received = 0  # chunks copied so far

    @property
    def complete(self) -> bool:
        return self._received == self.num_chunks

    def add_chunk(self, index: int, data: bytes | memoryview) -> None:
        """Copy chunk ``index`` into place. Chunks must come in order and have their announced size."""
        if self.complete:
            raise TensorDecodeError(f"{self.name}: extra chunk {index}; all {self.num_chunks} already received")
        if index != self._received:
            raise TensorDecodeError(f"{self.name}: chunk {index} out of order; expected chunk {self._received}")
        start = index * self.chunk_size
        want = min(self.chunk_size, self.byte_size - start)
        if len(data) != want:
            raise TensorDecodeError(
                f"{self.name}: chunk {index} has {len(data)} bytes, expected {want} "
                f"(byte_size {self.byte_size}, chunk_size {self.chunk_size})"
            )
        self._buf[start : start + want] = data
        self._received += 1

    def tensor(self) -> torch.Tensor:
        """The finished tensor, a view over the assembled buffer."""
        if not self.complete:
            raise TensorDecodeError(
                f"{self.name}: only {self._received} of {self.num_chunks} chunks received (missing chunks)"
            )
        if self.byte_size == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        return torch.frombuffer(self._buf, dtype=self.dtype).reshape(self.shape)


def decode_tensor(
    header: tensor_pb2.TensorHeader, chunks: Sequence[bytes] = (), *, max_bytes: int, name: str = "tensor"
) -> torch.Tensor:
    """Header plus all chunks (or inline data) → tensor."""
    assembler = TensorAssembler(header, max_bytes=max_bytes, name=name)
    for i, chunk in enumerate(chunks):
        assembler.add_chunk(i, chunk)
    return assembler.tensor()


# --- protobuf wire helpers for payload frames ---------------------------------------------------------------
# A payload frame is StepRequest{payload: PayloadFrame{item_identifier, field_name, header?, chunk}}. The
# small parts are serialized by protobuf; the chunk bytes are appended by hand so they are copied exactly once
# (into the frame) instead of into a message, then a serialization buffer.

_LEN = 2  # wire type of length-delimited fields


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field_number: int, wire_type: int) -> bytes:
    return _varint(field_number << 3 | wire_type)


def iter_payload_frames(
    item_identifier: str,
    field_name: str,
    tensor: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Iterator[bytes]:
    """Serialized ``StepRequest`` messages carrying one field of one item: the header in the first frame,
    then one chunk per frame. Built one at a time, so a sender holds a single chunk-sized frame at once; the
    same bytes can be written to any number of rank streams."""
    from mmcast.v1 import worker_pb2  # local import: the codec itself does not depend on the step protocol

    header, chunks = encode_tensor(tensor, chunk_size=chunk_size)
    views: list[memoryview | None] = list(chunks) if chunks else [None]
    for index, view in enumerate(views):
        head = worker_pb2.PayloadFrame(item_identifier=item_identifier, field_name=field_name)
        if index == 0:
            head.header.CopyFrom(header)
        prefix = head.SerializeToString()
        if view is None:
            yield _key(2, _LEN) + _varint(len(prefix)) + prefix
            continue
        chunk_head = tensor_pb2.TensorChunk(index=index).SerializeToString()
        chunk_len = len(chunk_head) + 1 + len(_varint(len(view))) + len(view)
        prefix += _key(4, _LEN) + _varint(chunk_len) + chunk_head + _key(2, _LEN) + _varint(len(view))
        yield b"".join((_key(2, _LEN), _varint(len(prefix) + len(view)), prefix, view))


def payload_frames(
    item_identifier: str, field_name: str, tensor: torch.Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> list[bytes]:
    """All frames of ``iter_payload_frames`` at once."""
    return list(iter_payload_frames(item_identifier, field_name, tensor, chunk_size=chunk_size))
