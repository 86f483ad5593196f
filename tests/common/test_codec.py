"""The chunked tensor codec: round trips and every malformed-input case."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from common import codec
from mmcast.v1 import tensor_pb2, worker_pb2

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (5, 13), (2, 3, 4)]


def sample(dtype, shape):
    if dtype is torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-100 if dtype is not torch.uint8 else 0, 100, shape, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 1 << 20])
def test_round_trip(dtype, shape, chunk_size):
    t = sample(dtype, shape)
    header, chunks = codec.encode_tensor(t, chunk_size=chunk_size)
    out = codec.decode_tensor(header, [bytes(c) for c in chunks], max_bytes=1 << 30)
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def test_inline_round_trip_and_non_contiguous_input():
    t = torch.arange(24, dtype=torch.int64).reshape(4, 6).t()
    header, chunks = codec.encode_tensor(t, inline=True)
    assert chunks == [] and header.num_chunks == 0
    assert torch.equal(codec.decode_tensor(header, max_bytes=1 << 20), t)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 5000), st.integers(1, 700), st.sampled_from(DTYPES))
def test_round_trip_property(numel, chunk_size, dtype):
    t = sample(dtype, (numel,))
    header, chunks = codec.encode_tensor(t, chunk_size=chunk_size)
    assert header.byte_size == numel * t.element_size()
    assert all(len(c) == chunk_size for c in chunks[:-1])
    assert torch.equal(codec.decode_tensor(header, [bytes(c) for c in chunks], max_bytes=1 << 30), t)


def test_decoded_tensor_is_a_view_of_the_assembled_buffer():
    t = torch.randn(300, 10)
    header, chunks = codec.encode_tensor(t, chunk_size=1000)
    asm = codec.TensorAssembler(header, max_bytes=1 << 20)
    for i, c in enumerate(chunks):
        asm.add_chunk(i, bytes(c))
    out = asm.tensor()
    asm._buf[0:4] = b"\x00\x00\x00\x00"  # the tensor shares the buffer: no second copy was made
    assert out[0, 0].item() == 0.0


def header_for(t, chunk_size=16):
    header, chunks = codec.encode_tensor(t, chunk_size=chunk_size)
    return header, [bytes(c) for c in chunks]


def test_rejects_unknown_dtype():
    h, _ = header_for(torch.zeros(8))
    h.dtype = 99
    with pytest.raises(codec.TensorDecodeError, match="unknown dtype 99"):
        codec.TensorAssembler(h, max_bytes=1 << 20, name="pixel_values")


def test_rejects_byte_size_disagreeing_with_shape():
    h, _ = header_for(torch.zeros(8))
    h.byte_size = 31
    with pytest.raises(codec.TensorDecodeError, match=r"pixel_values: header byte_size 31 != 32"):
        codec.TensorAssembler(h, max_bytes=1 << 20, name="pixel_values")


def test_rejects_negative_dimension():
    h = tensor_pb2.TensorHeader(dtype=tensor_pb2.DTYPE_FLOAT32, shape=[-1, 4], byte_size=0)
    with pytest.raises(codec.TensorDecodeError, match="negative dimension"):
        codec.TensorAssembler(h, max_bytes=1 << 20)


def test_rejects_over_limit_before_allocating():
    h = tensor_pb2.TensorHeader(
        dtype=tensor_pb2.DTYPE_FLOAT32,
        shape=[1 << 20, 1 << 20],
        byte_size=4 << 40,
        num_chunks=4 << 20,
        chunk_size=1 << 20,
    )
    with pytest.raises(codec.TensorDecodeError, match="exceeds the limit of 1048576 bytes"):
        codec.TensorAssembler(h, max_bytes=1 << 20, name="big")


def test_rejects_inconsistent_chunk_count():
    h, _ = header_for(torch.zeros(8), chunk_size=8)
    h.num_chunks = 3
    with pytest.raises(codec.TensorDecodeError, match="3 chunks announced"):
        codec.TensorAssembler(h, max_bytes=1 << 20)


def test_rejects_out_of_order_chunk():
    h, chunks = header_for(torch.arange(16, dtype=torch.float32))
    asm = codec.TensorAssembler(h, max_bytes=1 << 20, name="t")
    with pytest.raises(codec.TensorDecodeError, match="chunk 1 out of order; expected chunk 0"):
        asm.add_chunk(1, chunks[1])


def test_rejects_short_chunk():
    h, chunks = header_for(torch.arange(16, dtype=torch.float32))
    asm = codec.TensorAssembler(h, max_bytes=1 << 20, name="t")
    with pytest.raises(codec.TensorDecodeError, match="chunk 0 has 15 bytes, expected 16"):
        asm.add_chunk(0, chunks[0][:-1])


def test_rejects_missing_chunks():
    h, chunks = header_for(torch.arange(16, dtype=torch.float32))
    asm = codec.TensorAssembler(h, max_bytes=1 << 20, name="t")
    asm.add_chunk(0, chunks[0])
    with pytest.raises(codec.TensorDecodeError, match="only 1 of 4 chunks received"):
        asm.tensor()


def test_rejects_extra_chunk():
    h, chunks = header_for(torch.arange(4, dtype=torch.float32))
    asm = codec.TensorAssembler(h, max_bytes=1 << 20, name="t")
    asm.add_chunk(0, chunks[0])
    with pytest.raises(codec.TensorDecodeError, match="extra chunk 1"):
        asm.add_chunk(1, chunks[0])


def test_rejects_inline_size_mismatch_and_mixed_inline_chunks():
    h, _ = codec.encode_tensor(torch.zeros(4), inline=True)
    h.inline_data = h.inline_data[:-1]
    with pytest.raises(codec.TensorDecodeError, match="inline data has 15 bytes"):
        codec.TensorAssembler(h, max_bytes=1 << 20)
    h2, _ = header_for(torch.zeros(8))
    h2.inline_data = b"x"
    with pytest.raises(codec.TensorDecodeError, match="both inline data"):
        codec.TensorAssembler(h2, max_bytes=1 << 20)


def test_rejects_absurd_chunk_size():
    h, _ = header_for(torch.zeros(8))
    h.chunk_size = codec.MAX_CHUNK_SIZE + 1
    h.num_chunks = 1
    with pytest.raises(codec.TensorDecodeError, match="chunk_size"):
        codec.TensorAssembler(h, max_bytes=1 << 30)


@pytest.mark.parametrize("numel", [0, 1, 300_000, 600_000])
def test_payload_frames_parse_as_scheduler_frames(numel):
    t = torch.randn(numel)
    frames = codec.payload_frames("item-1", "pixel_values", t, chunk_size=1 << 20)
    asm = None
    for i, raw in enumerate(frames):
        frame = worker_pb2.StepRequest.FromString(raw)
        assert frame.WhichOneof("frame") == "payload"
        assert frame.payload.item_identifier == "item-1" and frame.payload.field_name == "pixel_values"
        assert frame.payload.HasField("header") == (i == 0)
        assert frame.ByteSize() == len(raw)
        if i == 0:
            asm = codec.TensorAssembler(frame.payload.header, max_bytes=1 << 30)
        if frame.payload.HasField("chunk"):
            asm.add_chunk(frame.payload.chunk.index, frame.payload.chunk.data)
    assert torch.equal(asm.tensor(), t)
