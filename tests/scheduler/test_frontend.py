"""Frontend on the project's tiny Qwen2-VL: equality with the HF processor, the processor-cache and upload-by-hash
paths, and every limit's error."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from common.errors import InvalidArgument, NotFound, ResourceExhausted
from common.hashing import item_identifier
from common.multimodal import ENCODED_FIELD, FieldKind, PayloadEncoding, PayloadState
from common.processor import load_processor
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.engine import frontend_media as frontend_module  # where images are hashed
from scheduler_svc.engine.frontend import ChatTurn, Frontend, ImagePart, TextPart
from scheduler_svc.engine.upload_store import UploadStore
from tests.support.oracle import image_as_sent


def png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header announces ``width`` x ``height`` but which carries almost no data (a bomb's shape)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


IMG_A, IMG_B, IMG_C = png(90, 60, 1), png(50, 100, 2), png(70, 70, 3)


def conversation(a=IMG_A, b=IMG_B):
    return [
        ChatTurn("system", [TextPart("You look at pictures.")]),
        ChatTurn("user", [TextPart("hello"), ImagePart(a), TextPart("and"), ImagePart(b)]),
        ChatTurn("assistant", [TextPart("Two pictures.")]),
        ChatTurn("user", [TextPart("again"), ImagePart(a)]),
    ]


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    return load_processor(tiny_model_dir)


def make_frontend(model_dir, **overrides) -> Frontend:
    overrides.setdefault("payload_encoding", "pixels")  # the decoding path; the header-only one has its own tests
    return Frontend(model_dir, SchedulerConfig(**overrides))


def summary(prompt):
    return (
        prompt.token_ids,
        [(f.identifier, f.mm_position, f.payload_nbytes) for f in prompt.mm_features],
        [f.data["pixel_values"].data for f in prompt.mm_features],
        [f.data["image_grid_thw"].data for f in prompt.mm_features],
    )


def assert_same(p, q):
    ids_p, meta_p, pix_p, grid_p = summary(p)
    ids_q, meta_q, pix_q, grid_q = summary(q)
    assert ids_p == ids_q and meta_p == meta_q
    assert all(torch.equal(x, y) for x, y in zip(pix_p, pix_q, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(grid_p, grid_q, strict=True))


def test_cold_path_matches_the_hf_processor(tiny_model_dir, processor):
    fe = make_frontend(tiny_model_dir)
    prompt = fe.process(conversation())
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You look at pictures."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "hello"},
                {"type": "image"},
                {"type": "text", "text": "and"},
                {"type": "image"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Two pictures."}]},
        {"role": "user", "content": [{"type": "text", "text": "again"}, {"type": "image"}]},
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    images = [image_as_sent(x) for x in (IMG_A, IMG_B, IMG_A)]
    ref = processor(text=[text], images=images, return_tensors="pt")
    assert prompt.token_ids == ref["input_ids"][0].tolist()
    assert prompt.num_images == 3 and prompt.processor_cache_hits == 1  # the repeated image
    pixel_values = torch.cat([f.data["pixel_values"].data for f in prompt.mm_features])
    assert torch.equal(pixel_values, ref["pixel_values"])
    grids = torch.cat([f.data["image_grid_thw"].data for f in prompt.mm_features])
    assert torch.equal(grids, ref["image_grid_thw"])
    # Placeholder ranges are exactly the runs of image tokens.
    image_positions = torch.nonzero(ref["input_ids"][0] == fe.image_token_id).flatten().tolist()
    covered = [p for f in prompt.mm_features for p in range(f.mm_position.offset, f.mm_position.end)]
    assert covered == image_positions
    for f, data in zip(prompt.mm_features, (IMG_A, IMG_B, IMG_A), strict=True):
        assert f.identifier == item_identifier(data, fe.processor_settings)
        assert f.payload_state is PayloadState.PRESENT
        assert f.data["pixel_values"].kind is FieldKind.FLAT and not f.data["pixel_values"].keep_on_cpu
        assert f.data["image_grid_thw"].kind is FieldKind.BATCHED and f.data["image_grid_thw"].keep_on_cpu
        assert f.payload_nbytes == f.data["pixel_values"].data.nbytes
    assert prompt.image_sha256 == [hashlib.sha256(x).hexdigest() for x in (IMG_A, IMG_B, IMG_A)]


def test_processor_cache_path_skips_decode_preprocess_and_identifier_hashing(tiny_model_dir, monkeypatch):
    fe = make_frontend(tiny_model_dir)
    cold = fe.process(conversation())
    fe.commit(cold)

    def fail(*args, **kwargs):
        raise AssertionError("a cached image was processed or hashed again")

    monkeypatch.setattr(fe, "_decode", fail)
    monkeypatch.setattr(frontend_module, "item_identifier", fail)
    warm = fe.process(conversation())
    assert warm.processor_cache_hits == 3
    assert_same(cold, warm)


def test_upload_by_hash_path_matches_and_hashes_nothing(tiny_model_dir, monkeypatch):
    cold = make_frontend(tiny_model_dir).process(conversation())
    fe = make_frontend(tiny_model_dir)
    sha_a, already = fe.uploads.put(IMG_A)
    assert (sha_a, already) == (hashlib.sha256(IMG_A).hexdigest(), False)
    assert fe.uploads.put(IMG_A) == (sha_a, True)
    sha_b, _ = fe.uploads.put(IMG_B)
    turns = [
        ChatTurn("system", [TextPart("You look at pictures.")]),
        ChatTurn(
            "user",
            [TextPart("hello"), ImagePart(uploaded_sha256=sha_a), TextPart("and"), ImagePart(uploaded_sha256=sha_b)],
        ),
        ChatTurn("assistant", [TextPart("Two pictures.")]),
        ChatTurn("user", [TextPart("again"), ImagePart(uploaded_sha256=sha_a)]),
    ]
    first = fe.process(turns)  # processor cache cold: decoded and processed from the stored bytes
    assert_same(cold, first)
    fe.commit(first)  # what the service does once the request is admitted

    class NoHashing:
        def __getattr__(self, name):
            raise AssertionError("an uploaded, already processed image was hashed")

    monkeypatch.setattr(frontend_module, "hashlib", NoHashing())
    monkeypatch.setattr(frontend_module, "item_identifier", NoHashing().__getattr__)
    second = fe.process(turns)
    assert second.processor_cache_hits == 3
    assert_same(cold, second)


def test_processor_cache_is_lru_within_its_byte_budget(tiny_model_dir):
    one = make_frontend(tiny_model_dir).process([ChatTurn("user", [ImagePart(IMG_A)])]).mm_features[0]
    budget = one.payload_nbytes + 100  # room for one processed image of this size
    fe = make_frontend(tiny_model_dir, processor_cache_bytes=budget)

    def admitted(image):
        prompt = fe.process([ChatTurn("user", [ImagePart(image)])])
        fe.commit(prompt)
        return prompt

    admitted(IMG_A)
    assert admitted(IMG_A).processor_cache_hits == 1
    admitted(IMG_C)  # evicts A
    assert admitted(IMG_A).processor_cache_hits == 0
    assert fe.cache.used <= budget


def test_upload_store_is_bounded_lru_and_reports_the_missing_hash():
    store = UploadStore(budget_bytes=250, max_upload_bytes=200)
    a, b, c = b"a" * 100, b"b" * 100, b"c" * 100
    sha_a, _ = store.put(a)
    sha_b, _ = store.put(b)
    store.get(sha_a)  # a is now more recent than b
    sha_c, _ = store.put(c)  # evicts b
    assert store.get(sha_a) == a and store.get(sha_c) == c
    with pytest.raises(NotFound, match=sha_b):
        store.get(sha_b)
    with pytest.raises(ResourceExhausted, match="--max-upload-bytes"):
        store.put(b"x" * 201)
    with pytest.raises(ResourceExhausted, match="--upload-store-bytes"):
        UploadStore(budget_bytes=50, max_upload_bytes=200).put(b"x" * 60)
    assert store.put(b"d" * 10, sha256_hex="caller-computed")[0] == "caller-computed"


# --- limits -------------------------------------------------------------------------------------------------------
def user(*parts):
    return [ChatTurn("user", list(parts))]


@pytest.mark.parametrize(
    ("overrides", "turns", "error", "needles"),
    [
        ({}, [ChatTurn("robot", [TextPart("hi")])], InvalidArgument, ["messages[0].role='robot'", "user"]),
        ({}, [], InvalidArgument, ["messages is empty"]),
        ({}, user(TextPart("   ")), InvalidArgument, ["prompt is empty"]),
        (
            {"max_images_per_request": 2},
            user(ImagePart(IMG_A), ImagePart(IMG_B), ImagePart(IMG_C)),
            InvalidArgument,
            ["messages[0].content[2].image", "more than 2 images", "--max-images-per-request"],
        ),
        (
            {},
            user(TextPart("x"), ImagePart(b"not an image at all")),
            InvalidArgument,
            ["messages[0].content[1].image", "19 bytes are not a decodable image"],
        ),
        ({}, user(ImagePart(png_header(0, 10))), InvalidArgument, ["messages[0].content[0].image"]),
        (
            {"max_image_pixels": 10_000},
            user(ImagePart(png_header(300, 300))),
            InvalidArgument,
            ["messages[0].content[0].image", "300x300 = 90000 pixels", "10000", "--max-image-pixels"],
        ),
        (
            {},
            user(ImagePart(png_header(20_000, 20_000))),
            InvalidArgument,
            ["messages[0].content[0].image", "--max-image-pixels"],
        ),
        (
            {"max_upload_bytes": 100},
            user(ImagePart(IMG_A)),
            ResourceExhausted,
            ["messages[0].content[0].image", f"{len(IMG_A)} bytes", "100", "--max-upload-bytes"],
        ),
        (
            {"max_request_bytes": 1024},
            user(TextPart("y" * 2000)),
            ResourceExhausted,
            ["2000 bytes", "1024", "--max-request-bytes"],
        ),
        (
            {},
            user(ImagePart(uploaded_sha256="ab" * 32)),
            NotFound,
            ["messages[0].content[0].image.uploaded_sha256=" + "ab" * 32, "--upload-store-bytes"],
        ),
        ({}, user(ImagePart()), InvalidArgument, ["neither data nor uploaded_sha256"]),
        (
            {"max_model_len": 40},
            user(TextPart("a long question " * 10)),
            InvalidArgument,
            ["messages: ", "prompt tokens", "context of 40 tokens", "--max-model-len"],
        ),
        (
            {},
            user(TextPart("sneaky <|image_pad|> token")),
            InvalidArgument,
            ["messages[0].content[0].text", "<|image_pad|>"],
        ),
    ],
)
def test_every_limit_has_its_error(tiny_model_dir, overrides, turns, error, needles):
    fe = make_frontend(tiny_model_dir, **overrides)
    with pytest.raises(error) as info:
        fe.process(turns)
    for needle in needles:
        assert needle in info.value.message
    assert (
        info.value.status.value
        == {InvalidArgument: "INVALID_ARGUMENT", ResourceExhausted: "RESOURCE_EXHAUSTED", NotFound: "NOT_FOUND"}[error]
    )


def test_evicted_upload_is_not_found_even_when_processed_before(tiny_model_dir):
    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels"), upload_store=UploadStore(len(IMG_A) + 10))
    sha_a, _ = fe.uploads.put(IMG_A)
    fe.process(user(ImagePart(uploaded_sha256=sha_a)))
    fe.uploads.put(IMG_B)  # evicts A from the store
    with pytest.raises(NotFound, match=sha_a):
        fe.process(user(ImagePart(uploaded_sha256=sha_a)))


def test_duck_typed_parts_and_their_field_names(tiny_model_dir):
    @dataclasses.dataclass
    class Part:
        data: bytes | None
        uploaded_sha256: str | None
        field: str

    fe = make_frontend(tiny_model_dir)
    with pytest.raises(InvalidArgument, match=r"^messages\[7\]\.content\[3\]\.image: "):
        fe.process(user(Part(b"garbage", None, "messages[7].content[3].image")))
    prompt = fe.process(user(TextPart("look"), Part(IMG_A, None, "x")), add_generation_prompt=False)
    assert prompt.num_images == 1
    assert fe.uses_mrope and fe.eos_token_ids and fe.max_model_len > 0


@pytest.mark.parametrize("mode", ("full", "strip", "lazy"))
def test_processed_prompt_goes_through_the_scheduler_onto_the_wire(tiny_model_dir, mode):
    from common import codec
    from common.item_proto import feature_from_proto
    from mmcast.v1 import worker_pb2
    from scheduler_svc.core.inputs import GroupBudget
    from scheduler_svc.core.request import Request, RequestSampling
    from scheduler_svc.core.scheduler import Scheduler
    from scheduler_svc.transport.plan_proto import step_control

    fe = make_frontend(tiny_model_dir)
    prompt = fe.process(conversation())
    config = SchedulerConfig(transfer_mode=mode, max_model_len=fe.max_model_len, encoder_placement="replicated")
    sched = Scheduler(config, GroupBudget(2, 64, 4096, 64 << 20), fe.uses_mrope, fe.eos_token_ids)
    sched.add_request(Request("r", prompt.token_ids, prompt.mm_features, RequestSampling(max_tokens=2)))
    plan = sched.schedule()
    control = worker_pb2.StepControl.FromString(step_control(plan).SerializeToString())
    (new,) = control.new_requests
    assert list(new.prompt_token_ids) == prompt.token_ids
    assert [e.item_identifier for e in control.encoder_inputs] == [f.identifier for f in prompt.mm_features[:2]]
    assert [s.identifier for s in plan.rank_payloads[1]] == [f.identifier for f in prompt.mm_features[:2]]
    for send in plan.rank_payloads[0]:
        (field,) = send.feature.data.payload_fields().items()  # what the rank streams write: pixel_values alone
        raw = codec.payload_frames(send.identifier, field[0], field[1].data, chunk_size=4096)
        frames = [worker_pb2.StepRequest.FromString(b).payload for b in raw]
        assembler = codec.TensorAssembler(frames[0].header, max_bytes=1 << 30, name="pixel_values")
        for frame in frames:
            assembler.add_chunk(frame.chunk.index, frame.chunk.data)
        item = next(m for m in new.mm_items if m.identifier == send.identifier)
        rebuilt = feature_from_proto(item, {"pixel_values": assembler.tensor()})
        assert torch.equal(rebuilt.data["pixel_values"].data, send.feature.data["pixel_values"].data)
        assert torch.equal(rebuilt.data["image_grid_thw"].data, send.feature.data["image_grid_thw"].data)
        assert rebuilt.mm_position == send.feature.mm_position


def test_encoded_prompt_is_built_from_headers_and_carries_the_file_as_sent(tiny_model_dir, processor):
    """--payload-encoding encoded: the same prompt, positions and identifiers as the decoding path, the grid the
    processor gives, the client's bytes as the payload, and no image decoded."""
    encoded, pixels = make_frontend(tiny_model_dir, payload_encoding="encoded"), make_frontend(tiny_model_dir)
    tall = png(30, 200, 4)  # resized by the processor's rule: the grid is not the file's size over the patch
    turns = conversation(IMG_A, tall)
    e, p = encoded.process(turns), pixels.process(turns)
    assert encoded.counts["images_decoded"] == 0 and pixels.counts["images_decoded"] == 2
    assert e.token_ids == p.token_ids and [k for k, _ in e.pending_cache] == [k for k, _ in p.pending_cache]
    ref_grids = processor.image_processor(images=[image_as_sent(x) for x in (IMG_A, tall, IMG_A)], return_tensors="pt")[
        "image_grid_thw"
    ]
    for f, g, raw, ref_grid in zip(e.mm_features, p.mm_features, (IMG_A, tall, IMG_A), ref_grids, strict=True):
        assert f.encoding is PayloadEncoding.ENCODED and g.encoding is PayloadEncoding.PIXELS
        assert (f.identifier, f.mm_position) == (g.identifier, g.mm_position)
        assert list(f.data.payload_fields()) == [ENCODED_FIELD]
        assert f.data[ENCODED_FIELD].data.numpy().tobytes() == raw and f.payload_nbytes == len(raw)
        assert torch.equal(f.data["image_grid_thw"].data, ref_grid.reshape(1, 3))
    assert e.image_cpu_seconds > 0


def test_encoded_images_seen_before_come_from_the_processor_cache(tiny_model_dir):
    """Under encoded an admitted image's item is kept: sent again (same tenant) it is neither opened nor hashed
    again, and its item (identifier, grid, the file as payload) is the one built the first time; another tenant's
    same bytes are an item of their own."""
    fe = make_frontend(tiny_model_dir, payload_encoding="encoded")
    turns = conversation(IMG_A, IMG_B)
    first = fe.process(turns)
    # IMG_A twice in the conversation: its repeat is the one hit
    assert first.processor_cache_hits == 1 and len(first.pending_cache) == 2
    refused = fe.process(turns)  # not committed (a refused request): nothing was kept
    assert refused.processor_cache_hits == 1
    fe.commit(first)
    again = fe.process(turns)
    assert again.processor_cache_hits == 3 and again.pending_cache == [] and again.token_ids == first.token_ids
    for a, f in zip(again.mm_features, first.mm_features, strict=True):
        assert (a.identifier, a.mm_position, a.encoding) == (f.identifier, f.mm_position, f.encoding)
        assert a.data[ENCODED_FIELD].data is f.data[ENCODED_FIELD].data  # the kept file, shared
    other = fe.process(turns, tenant="other")
    assert other.processor_cache_hits == 1  # IMG_A repeated within the request; nothing from the first tenant
    assert other.mm_features[0].identifier != first.mm_features[0].identifier
    used = fe.cache.used
    fe.commit(other)
    fe.forget(other)  # the request failed afterwards: what it added goes, the first tenant's entries stay
    assert fe.cache.used == used and fe.process(turns).processor_cache_hits == 3
    fe.forget(first)
    assert fe.cache.used == 0 and fe.process(turns).processor_cache_hits == 1


def test_encoded_items_round_trip_the_wire_with_their_encoding(tiny_model_dir):
    from common.item_proto import feature_from_proto, feature_to_proto
    from mmcast.v1 import multimodal_pb2

    fe = make_frontend(tiny_model_dir, payload_encoding="encoded")
    (f,) = fe.process([ChatTurn("user", [ImagePart(IMG_C), TextPart("what is it")])]).mm_features
    msg = feature_to_proto(f)
    assert msg.encoding == multimodal_pb2.PAYLOAD_ENCODING_ENCODED
    assert [(x.name, x.keep_on_cpu) for x in msg.fields] == [(ENCODED_FIELD, False), ("image_grid_thw", True)]
    back = feature_from_proto(msg, {ENCODED_FIELD: f.data[ENCODED_FIELD].data})
    assert back.encoding is PayloadEncoding.ENCODED and back.payload_nbytes == len(IMG_C)
    msg.encoding = 7
    with pytest.raises(ValueError, match="encoding=7 is not a known payload encoding"):
        feature_from_proto(msg)


def test_videos_under_pixels_are_processed_once_per_sampling(tiny_model_dir):
    """A video seen before (same tenant, bytes and sampling) comes from the processor cache: no header read, no
    decode, the same item; sampled otherwise it is another item, decoded again. Under encoded nothing is decoded."""
    from common.multimodal import Modality
    from scheduler_svc.doors.request_parsing import video_options
    from scheduler_svc.engine.request_input import VideoContent
    from tests.video_clips import make_clip

    clip = make_clip(codec="h264", width=112, height=84, fps=8, seconds=2.0, seed=3)

    def turn(fps):
        options = video_options("v", fps=fps, num_frames=None, max_frames=None, min_pixels=None, max_pixels=None)
        return [ChatTurn("user", [VideoContent(clip, None, "v", options), TextPart("what happens?")])]

    fe = make_frontend(tiny_model_dir)
    first = fe.process(turn(2.0))
    fe.commit(first)
    again = fe.process(turn(2.0))
    other = fe.process(turn(4.0))
    assert fe.counts["videos_decoded"] == 2, fe.counts  # the first and the 4-fps sampling
    assert again.processor_cache_hits == 1 and again.token_ids == first.token_ids
    a, f = again.mm_features[0], first.mm_features[0]
    assert (a.identifier, a.mm_position) == (f.identifier, f.mm_position)
    assert a.data["pixel_values_videos"].data is f.data["pixel_values_videos"].data  # the cached tensor, shared
    assert first.mm_features[0].modality is Modality.VIDEO and first.num_videos == 1 and first.num_images == 0
    assert other.mm_features[0].identifier != first.mm_features[0].identifier
    assert other.mm_features[0].mm_position.length > first.mm_features[0].mm_position.length
    encoded = make_frontend(tiny_model_dir, payload_encoding="encoded")
    fe_item = encoded.process(turn(2.0)).mm_features[0]
    assert encoded.counts["videos_decoded"] == 0 and fe_item.identifier == first.mm_features[0].identifier
