"""Fuzzing (hypothesis) of everything that parses untrusted bytes: the tensor codec and the worker's payload
assembly, the worker's step decoder (plan → commit → execute on an in-process rank), and the frontend's parsing
of client requests (``request_parsing.parse_*`` + ``Frontend.process``, images included).

The property is always the same: bad input ends in the component's own error type (``TensorDecodeError`` /
``FrameError``, a ``StepError`` other than INTERNAL, an ``MmcastError``) and good input succeeds — never another
exception, which would be a crash or, on a rank, an INTERNAL refusal (and with TP > 1 an exit of the group).

Budgets: the ``quick`` variants run in ``make test`` (a few seconds each); the ``fuzz``-marked variants run with
``make fuzz`` (``--run-fuzz``) at a hundred times the examples.
"""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from common import codec
from common.errors import MmcastError
from mmcast.v1 import generation_pb2, multimodal_pb2, tensor_pb2, worker_pb2
from worker_svc.caches import FrameError, PayloadAssembler
from worker_svc.step_errors import StepError, code

SCALE = 100  # make fuzz runs every property with this many times the examples of make test


def run(prop, examples: int, long: bool = False) -> None:
    """Runs a fresh hypothesis property with ``examples`` examples (times ``SCALE`` for the long variant)."""
    settings(
        max_examples=examples * (SCALE if long else 1),
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )(prop)()


# --- the tensor codec and the worker's payload assembly -------------------------------------------------------

DTYPES = [
    tensor_pb2.DTYPE_FLOAT32,
    tensor_pb2.DTYPE_BFLOAT16,
    tensor_pb2.DTYPE_FLOAT16,
    tensor_pb2.DTYPE_INT64,
    tensor_pb2.DTYPE_INT32,
    tensor_pb2.DTYPE_UINT8,
    tensor_pb2.DTYPE_BOOL,
]
MAX_BYTES = 4096  # the assembler's limit in these tests: every accepted tensor is small
dims = st.one_of(st.integers(0, 6), st.integers(-3, 2**63 - 1), st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1]))


@st.composite
def headers(draw) -> tensor_pb2.TensorHeader:
    dtype = draw(st.one_of(st.sampled_from(DTYPES), st.integers(-5, 40)))
    shape = draw(st.lists(dims, max_size=5))
    header = tensor_pb2.TensorHeader(dtype=dtype, shape=shape)
    itemsize = {1: 4, 2: 2, 3: 2, 4: 8, 5: 4, 6: 1, 7: 1}.get(dtype, 1)
    consistent = math.prod(shape) * itemsize if all(d >= 0 for d in shape) else 0
    byte_size = draw(st.one_of(st.just(consistent), st.integers(0, 2**64 - 1), st.integers(0, 64)))
    header.byte_size = byte_size if byte_size < 2**64 else 0
    if draw(st.booleans()):
        header.inline_data = draw(st.binary(max_size=80))
    chunk_size = draw(st.one_of(st.integers(0, 70), st.just(codec.MAX_CHUNK_SIZE + 1), st.integers(0, 2**32 - 1)))
    header.chunk_size = chunk_size
    fitting = math.ceil(header.byte_size / chunk_size) if chunk_size else 0
    header.num_chunks = draw(st.one_of(st.just(min(fitting, 2**32 - 1)), st.integers(0, 2**32 - 1), st.integers(0, 5)))
    return header


def frames_for(header, draw_chunks) -> list[worker_pb2.PayloadFrame]:
    frames = [worker_pb2.PayloadFrame(item_identifier="item", field_name="pixel_values", header=header)]
    for index, data in draw_chunks:
        frames.append(
            worker_pb2.PayloadFrame(
                item_identifier="item", field_name="pixel_values", chunk=tensor_pb2.TensorChunk(index=index, data=data)
            )
        )
    return frames


def codec_property():
    @given(
        header=headers(),
        chunks=st.lists(st.tuples(st.integers(0, 6), st.binary(max_size=80)), max_size=6),
        truthful=st.booleans(),
    )
    def check(header, chunks, truthful):
        assemble(header, chunks, truthful)

    return check


def assemble(header, chunks, truthful) -> None:
    if truthful and header.chunk_size and 0 < header.byte_size <= MAX_BYTES:
        # chunks of the announced sizes, in order: exercises the success path as well as the checks
        size, step = header.byte_size, header.chunk_size
        chunks = [(i, bytes(min(step, size - i * step))) for i in range(math.ceil(size / step))]
    assembler = PayloadAssembler(MAX_BYTES)
    try:
        for frame in frames_for(header, chunks):
            assembler.add(frame)
        done = assembler.take()
    except FrameError:
        return
    tensor = done["item"]["pixel_values"]
    assert tensor.numel() * tensor.element_size() == header.byte_size <= MAX_BYTES
    assert list(tensor.shape) == list(header.shape)


def test_codec_frames_quick():
    run(codec_property(), 300)


@pytest.mark.fuzz
def test_codec_frames_long():
    run(codec_property(), 300, long=True)


def round_trip_property():
    @given(
        dtype=st.sampled_from(
            [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool]
        ),
        shape=st.lists(st.integers(0, 7), max_size=4),
        chunk_size=st.integers(1, 64),
        seed=st.integers(0, 2**31),
    )
    def check(dtype, shape, chunk_size, seed):
        round_trip(dtype, shape, chunk_size, seed)

    return check


def round_trip(dtype, shape, chunk_size, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    tensor = (
        torch.randint(0, 2, shape, generator=g) if dtype is torch.bool else torch.randint(-100, 100, shape, generator=g)
    ).to(dtype)
    assembler = PayloadAssembler(1 << 20)
    for raw in codec.payload_frames("item", "f", tensor, chunk_size=chunk_size):
        assembler.add(worker_pb2.StepRequest.FromString(raw).payload)
    out = assembler.take()["item"]["f"]
    assert out.dtype == tensor.dtype and out.shape == tensor.shape and torch.equal(out, tensor)


def test_codec_round_trip_quick():
    run(round_trip_property(), 100)


@pytest.mark.fuzz
def test_codec_round_trip_long():
    run(round_trip_property(), 100, long=True)


# --- the worker's step decoder ----------------------------------------------------------------------------------


class Rank:
    """An in-process rank (world size 1) driven without gRPC: what the servicer does with each frame."""

    def __init__(self, model_dir) -> None:
        from tests.support.worker_driver import handshake, rank_token_file
        from worker_svc.config import WorkerConfig
        from worker_svc.metrics import WorkerMetrics
        from worker_svc.worker import Worker

        config = WorkerConfig(
            model=str(model_dir),
            listen="127.0.0.1:0",
            kv_blocks=32,
            max_tensor_bytes=1 << 20,
            payload_cache_bytes=4 << 20,
            encoder_cache_tokens=256,
            scheduler_id="test",
            shared_token_file=rank_token_file(),
        )
        self.worker = Worker(config, WorkerMetrics(), fatal=self._fatal)
        self.worker.load()
        self.model_dir = model_dir
        self.handshake = handshake
        self.vocab = self.worker.runner.vocab_size

    @staticmethod
    def _fatal(message, **extra):
        raise AssertionError(f"the rank would have exited: {message} {extra}")

    def run(self, steps) -> list:
        """Applies (payload frames, control) pairs on a fresh stream until one is refused; returns the outcomes."""
        handle = self.worker.open_stream(self.handshake(self.model_dir))
        outcomes = []
        try:
            for frames, control in steps:
                try:
                    for frame in frames:
                        if handle.pending_error is None:
                            try:
                                handle.session.receive_payload(frame)
                            except StepError as exc:
                                handle.pending_error = exc
                    outcomes.append(self.worker.apply_step(handle, control))
                except StepError as exc:
                    assert exc.code != code.INTERNAL, f"INTERNAL refusal (a crash in the rank): {exc.message}"
                    outcomes.append(exc)
                    break
        finally:
            self.worker.close_stream(handle)
            self.worker.executor.submit(lambda: None).result()  # the session's clear has run
        return outcomes


@pytest.fixture(scope="module")
def rank(tiny_model_dir):
    return Rank(tiny_model_dir)


PATCH_DIM = 1176  # 3 channels x 2 frames x 14 x 14 (the tiny Qwen2-VL's vision patch)
ids = st.sampled_from(["a", "b", "c"])
# Each identifier has one consistent grid, so that well-formed steps reach the encoder and the model.
GRIDS = {"i1": (1, 2, 2), "i2": (1, 4, 4), "i3": (1, 2, 4)}
items = st.sampled_from(sorted(GRIDS))


def mostly(good, *bad, odds: int = 24):
    """``good`` most of the time, one of ``bad`` now and then (keeps most examples deep in the step)."""
    return st.integers(0, odds).flatmap(lambda k: st.one_of(*bad) if k == 0 and bad else good)


def grid_field(t, h, w) -> multimodal_pb2.MultiModalField:
    header, _ = codec.encode_tensor(torch.tensor([[t, h, w]], dtype=torch.int64), inline=True)
    return multimodal_pb2.MultiModalField(
        name="image_grid_thw", kind=multimodal_pb2.FIELD_KIND_BATCHED, keep_on_cpu=True, tensor=header
    )


def pixel_field(rows) -> multimodal_pb2.MultiModalField:
    header = tensor_pb2.TensorHeader(
        dtype=tensor_pb2.DTYPE_FLOAT32, shape=[rows, PATCH_DIM], byte_size=max(rows, 0) * PATCH_DIM * 4
    )
    return multimodal_pb2.MultiModalField(name="pixel_values", kind=multimodal_pb2.FIELD_KIND_FLAT, tensor=header)


@st.composite
def mm_items(draw, prompt_len):
    ident = draw(items)
    t, h, w = draw(
        mostly(
            st.just(GRIDS[ident]),
            st.sampled_from([(1, -2, 2), (0, 2, 2), (-1, -2, 4), (1, 2**20, 2), (2, 2, 2), (1, 3, 5)]),
        )
    )
    tokens = max(t * (h // 2) * (w // 2), 0)
    length = draw(mostly(st.just(tokens), st.integers(0, 6)))
    offset = draw(mostly(st.integers(0, max(prompt_len - length, 0)), st.integers(0, prompt_len + 2)))
    msg = multimodal_pb2.MultiModalItem(
        identifier=ident,
        modality=draw(mostly(st.just(1), st.sampled_from([0, 2, 7]))),
        position=multimodal_pb2.PlaceholderRange(offset=offset, length=length),
        payload_state=draw(mostly(st.sampled_from([1, 3, 3, 4]), st.sampled_from([0, 2, 9]))),
    )
    if not draw(st.integers(0, 8)):
        exact = length <= 64 and draw(st.booleans())
        size = dict(min_size=length, max_size=length) if exact else dict(max_size=6)
        msg.position.is_embed.extend(draw(st.lists(st.booleans(), **size)))
    if draw(st.integers(0, 12)):
        msg.fields.append(grid_field(t, h, w))
    if draw(st.integers(0, 12)):
        msg.fields.append(pixel_field(draw(mostly(st.just(t * h * w), st.sampled_from([1, 0, -1])))))
    return msg


@st.composite
def new_requests(draw, vocab, rid):
    n = draw(st.integers(1, 40))
    tokens = draw(st.lists(st.integers(0, vocab - 1), min_size=n, max_size=n))
    if not draw(st.integers(0, 30)):
        tokens[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, vocab, 2**31 - 1]))
    computed = draw(mostly(st.just(0), st.sampled_from([16, 32, 3])))
    msg = worker_pb2.NewRequest(
        request_id=draw(mostly(st.just(rid), st.just(""), ids)),
        prompt_token_ids=tokens,
        block_ids=draw(mostly(st.just(list(range(-(-n // 16)))), st.lists(st.integers(0, 33), max_size=4))),
        num_computed_tokens=computed,
        num_scheduled_tokens=draw(
            mostly(st.integers(max(n - computed, 0), max(n - computed, 0)), st.integers(0, n + 2))
        ),
        num_output_tokens=draw(mostly(st.just(0), st.sampled_from([1, 2, n]))),
        sampling=worker_pb2.WorkerSampling(
            temperature=draw(mostly(st.sampled_from([0.0, 0.7]), st.sampled_from([-1.0, float("nan"), float("inf")]))),
            top_p=draw(mostly(st.sampled_from([0.0, 0.5, 1.0]), st.sampled_from([2.0, float("nan")]))),
            seed=draw(st.integers(0, 2**64 - 1)),
            logprobs=draw(mostly(st.sampled_from([0, 3]), st.just(65))),
            return_logprobs=draw(st.booleans()),
            top_k=draw(mostly(st.sampled_from([0, 1, 5, vocab]), st.sampled_from([vocab + 1, 2**32 - 1]))),
        ),
    )
    msg.mm_items.extend(draw(st.lists(mm_items(n), max_size=2)))
    return msg


def payload(ident: str, rows: int, chunk_size: int) -> list[worker_pb2.PayloadFrame]:
    tensor = torch.randn((rows, PATCH_DIM), generator=torch.Generator().manual_seed(len(ident)))
    raws = codec.payload_frames(ident, "pixel_values", tensor, chunk_size=chunk_size)
    return [worker_pb2.StepRequest.FromString(r).payload for r in raws]


@st.composite
def steps(draw, vocab):
    out, held, step_id = [], [], 0
    for _ in range(draw(st.integers(1, 4))):
        step_id = draw(mostly(st.just(step_id + 1), st.just(0)))
        control = worker_pb2.StepControl(
            step_id=step_id,
            finished_request_ids=draw(
                mostly(st.lists(st.sampled_from(held), max_size=1) if held else st.just([]), st.lists(ids, max_size=1))
            ),
            evict_payload_ids=draw(st.lists(items, max_size=1)),
            evict_encoder_ids=draw(st.lists(items, max_size=1)),
            reset_caches=not draw(st.integers(0, 6)),
        )
        fresh = [r for r in "abc" if r not in held]
        for rid in draw(st.lists(st.sampled_from(fresh), max_size=2, unique=True)) if fresh else []:
            control.new_requests.append(draw(new_requests(vocab, rid)))
        for rid in draw(st.lists(st.sampled_from(held), max_size=2, unique=True)) if held else []:
            control.running.add(
                request_id=draw(mostly(st.just(rid), ids)),
                new_token_ids=draw(
                    st.lists(mostly(st.integers(0, vocab - 1), st.sampled_from([-1, vocab])), max_size=2)
                ),
                new_block_ids=draw(st.lists(st.integers(0, 33), max_size=2)),
                num_computed_tokens=draw(st.integers(0, 45)),
                num_scheduled_tokens=draw(st.integers(0, 3)),
            )
        announced = [i.identifier for r in control.new_requests for i in r.mm_items]
        wanted = draw(
            mostly(
                st.lists(st.sampled_from(announced), max_size=2, unique=True) if announced else st.just([]),
                st.lists(items, max_size=2, unique=True),
            )
        )
        control.encoder_inputs.extend(worker_pb2.EncoderInput(item_identifier=i) for i in wanted)
        frames = []
        for ident in draw(mostly(st.just(wanted), st.lists(items, max_size=2))):
            t, h, w = GRIDS[ident]
            rows = draw(mostly(st.just(t * h * w), st.sampled_from([1, 0])))
            chunks = payload(ident, rows, draw(st.sampled_from([1 << 20, 4096])))
            if len(chunks) > 1 and not draw(st.integers(0, 6)):
                chunks = chunks[:-1] if draw(st.booleans()) else chunks[::-1]  # a missing or misordered chunk
            frames += chunks
        out.append((frames, control))
        held = sorted((set(held) | {r.request_id for r in control.new_requests}) - set(control.finished_request_ids))
    return out


def step_property(rank):
    @given(plan=steps(rank.vocab))
    def check(plan):
        rank.run(plan)

    return check


def raw_frame_property(rank):
    @given(raw=st.binary(max_size=300))
    def check(raw):
        try:
            frame = worker_pb2.StepRequest.FromString(raw)
        except Exception:
            return  # the decode guard answers INVALID_ARGUMENT (tested through gRPC in the catalogue)
        kind = frame.WhichOneof("frame")
        if kind == "payload":
            rank.run([([frame.payload], worker_pb2.StepControl(step_id=1))])
        elif kind == "control":
            rank.run([([], frame.control)])

    return check


def test_step_decoder_quick(rank):
    run(step_property(rank), 120)


@pytest.mark.fuzz
def test_step_decoder_long(rank):
    run(step_property(rank), 120, long=True)


def test_raw_step_frames_quick(rank):
    run(raw_frame_property(rank), 100)


@pytest.mark.fuzz
def test_raw_step_frames_long(rank):
    run(raw_frame_property(rank), 100, long=True)


# --- the frontend's parsing of client requests ---------------------------------------------------------------


@pytest.fixture(scope="module")
def frontend(tiny_model_dir):
    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.engine.frontend import Frontend

    return Frontend(
        tiny_model_dir,
        SchedulerConfig(
            model=str(tiny_model_dir),
            max_model_len=512,
            max_images_per_request=3,
            max_image_pixels=1 << 16,
            max_upload_bytes=1 << 16,
            processor_cache_bytes=1 << 24,
        ),
    )


def png(seed: int, width: int = 28, height: int = 28) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


GOOD_IMAGES = [png(1), png(2, 56, 28)]
SPECIAL = [
    "<|image_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|video_pad|>",
    "<|endoftext|>",
    "\x00",
    "\ud800",
    "\U0010ffff",
    " ",
    "\n",
]


@st.composite
def image_bytes(draw):
    base = bytearray(draw(st.sampled_from(GOOD_IMAGES)))
    how = draw(st.sampled_from(["good", "flip", "truncate", "random", "header"]))
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            base[draw(st.integers(0, len(base) - 1))] = draw(st.integers(0, 255))
    elif how == "truncate":
        base = base[: draw(st.integers(1, len(base) - 1))]
    elif how == "random":
        return draw(st.binary(min_size=1, max_size=200))
    elif how == "header":  # IHDR width/height (bytes 16..24) rewritten: zero, huge, or mismatched sizes
        base[16:24] = draw(st.binary(min_size=8, max_size=8))
    return bytes(base)


@st.composite
def parts(draw):
    kind = draw(st.sampled_from(["text", "text", "image", "sha", "empty"]))
    part = generation_pb2.ContentPart()
    if kind == "text":
        pieces = draw(st.lists(st.one_of(st.text(max_size=30), st.sampled_from(SPECIAL)), max_size=4))
        part.text = "".join(p for p in pieces if p != "\ud800")  # lone surrogates cannot be protobuf strings
    elif kind == "image":
        part.image.data = draw(image_bytes())
    elif kind == "sha":
        part.image.uploaded_sha256 = draw(st.sampled_from(["", "0" * 64, "A" * 64, "g" * 64, "x"]))
    return part


@st.composite
def requests(draw):
    msg = generation_pb2.GenerateRequest(request_id=draw(st.sampled_from(["", "ok-1", "bad id", "x" * 200])))
    for _ in range(draw(st.integers(0, 3))):
        m = msg.messages.add(role=draw(st.sampled_from([1, 2, 3, 2, 0, 7, -1])))
        m.content.extend(draw(st.lists(parts(), max_size=3)))
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32), st.sampled_from([0.0, 1.0, 0.5]))
    s = msg.sampling
    s.max_tokens = draw(st.sampled_from([0, 1, 16, 511, 600, 2**32 - 1]))
    s.temperature = draw(floats)
    if draw(st.booleans()):
        s.top_p = draw(floats)
    s.logprobs = draw(st.sampled_from([0, 5, 20, 21, 2**32 - 1]))
    s.top_k = draw(st.sampled_from([0, 1, 50, 2**31, 2**32 - 1]))
    s.stop.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
    s.stop_token_ids.extend(draw(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=2)))
    s.presence_penalty, s.frequency_penalty = draw(floats), draw(floats)
    if draw(st.booleans()):
        s.repetition_penalty = draw(floats)
    s.logit_bias.update(draw(st.dictionaries(st.integers(-(2**31), 2**31 - 1), floats, max_size=3)))
    s.min_tokens = draw(st.sampled_from([0, 1, 600, 2**32 - 1]))
    s.bad_words.extend(draw(st.lists(st.text(max_size=5), max_size=2)))
    msg.cache_salt = draw(st.text(max_size=5))
    return msg


def parse_and_process(frontend, msg: generation_pb2.GenerateRequest) -> None:
    """What Generate does with a request before the engine: every limit, the processor, the context check."""
    from scheduler_svc.doors import request_parsing

    try:
        request_parsing.check_request_id(msg.request_id)
        request_parsing.check_cache_salt(msg.cache_salt)
        sampling = request_parsing.parse_sampling(
            msg.sampling, max_tokens_limit=512, max_logprobs=20, vocab_size=frontend.vocab_size
        )
        turns = request_parsing.parse_messages(msg.messages, max_images=frontend.config.max_images_per_request)
        processed = frontend.process(turns, tenant="fuzz")
    except MmcastError:
        return
    assert len(processed.token_ids) < frontend.max_model_len
    assert sampling.max_tokens >= 1 and 0.0 <= sampling.temperature <= 2.0 and 0.0 < sampling.top_p <= 1.0
    assert 0 <= sampling.top_k <= frontend.vocab_size
    pen = sampling.penalties
    assert abs(pen.presence_penalty) <= 2 and abs(pen.frequency_penalty) <= 2 and 0 < pen.repetition_penalty <= 1000
    assert all(0 <= t < frontend.vocab_size and abs(b) <= 100 for t, b in pen.logit_bias)
    assert pen.min_tokens <= sampling.max_tokens and all(w.strip() for w in pen.bad_words)
    assert all(f.mm_position.end <= len(processed.token_ids) for f in processed.mm_features)


def frontend_property(frontend):
    @given(msg=requests())
    def check(msg):
        parse_and_process(frontend, msg)

    return check


def test_frontend_requests_quick(frontend):
    run(frontend_property(frontend), 150)


@pytest.mark.fuzz
def test_frontend_requests_long(frontend):
    run(frontend_property(frontend), 150, long=True)


def raw_request_property(frontend):
    @given(
        raw=st.one_of(
            st.binary(max_size=200),
            requests()
            .map(lambda m: m.SerializeToString())
            .flatmap(lambda b: st.integers(0, len(b)).map(lambda k: b[:k])),
        )
    )
    def check(raw):
        try:
            msg = generation_pb2.GenerateRequest.FromString(raw)
        except Exception:
            return  # the decode guard's INVALID_ARGUMENT (the catalogue tests it through gRPC)
        parse_and_process(frontend, msg)

    return check


def test_frontend_raw_bytes_quick(frontend):
    run(raw_request_property(frontend), 150)


@pytest.mark.fuzz
def test_frontend_raw_bytes_long(frontend):
    run(raw_request_property(frontend), 150, long=True)
