"""The frontend's checks before work (common/image_header.py, scheduler_svc/engine/frontend.py): header-predicted
tokens equal the processor's output, refused formats and bombs are never decoded, long text is never tokenized,
a refused request leaves nothing in the processor cache, unfinished uploads are bounded and released."""

from __future__ import annotations

import io
import random
import threading

import pytest
from PIL import Image

from benchmarks.http_api import hostile_inputs as hostile
from common.errors import InvalidArgument, ResourceExhausted
from common.image_header import ImageHeaderReader
from common.processor import load_processor
from scheduler_svc.config import DEFAULT_IMAGE_FORMATS, SchedulerConfig
from scheduler_svc.engine.frontend import ChatTurn, Frontend, ImagePart, TextPart
from scheduler_svc.engine.upload_store import PendingUploads
from tests.support.images import exif_after_pixels


def encoded(width: int, height: int, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, height % 256, 77)).save(out, format=fmt, **save)
    return out.getvalue()


def user(*parts):
    return [ChatTurn("user", list(parts))]


SIZES = [
    (1, 1),
    (28, 28),
    (56, 56),
    (27, 29),
    (57, 113),
    (224, 224),
    (448, 448),
    (1280, 720),
    (720, 1280),
    (1000, 1000),
    (1001, 999),
    (3, 500),
    (599, 4),
    (700, 3),
    (1500, 900),
]
SIZES += [(random.Random(i).randint(1, 1100), random.Random(i + 99).randint(1, 1100)) for i in range(25)]


@pytest.mark.parametrize("variant", ["tiny_model_dir", "tiny_model_25_dir", "tiny_model_q3_dir"])
@pytest.mark.parametrize("max_pixels", [None, 150_000])  # the checkpoint's setting, and one most sizes exceed
def test_header_tokens_equal_the_processors_output(variant, max_pixels, request):
    processor = load_processor(request.getfixturevalue(variant)).image_processor
    if max_pixels is not None:  # a processor whose resize rule clamps (cheap to run, unlike 12.8 MP images)
        processor.size["longest_edge"] = max_pixels
    reader = ImageHeaderReader(DEFAULT_IMAGE_FORMATS, 1 << 40, processor)
    merge = processor.merge_size**2
    checked = 0
    for width, height in SIZES:
        if max(width, height) / min(width, height) > 200:  # the processor refuses these: so must the header check
            with pytest.raises(InvalidArgument, match="aspect ratio"):
                reader.open(encoded(width, height), "x")
            continue
        _, header = reader.open(encoded(width, height), "x")
        grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        assert (header.width, header.height) == (width, height)
        assert header.tokens == int(grid.prod()) // merge, (width, height, header.tokens, grid.tolist())
        checked += 1
    assert checked >= 35


def _exif(orientation: int) -> Image.Exif:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif


@pytest.fixture(scope="module")
def frontend(tiny_model_dir):
    return Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels"))


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_exif_orientation_is_read_from_the_header_without_decoding(frontend, monkeypatch, fmt, orientation):
    """Orientations 5-8 turn the image a quarter: the header's size is the upright one, read before any pixel is
    decoded, and the processed prompt takes the tokens it predicted."""
    from PIL import ImageFile, ImageOps, WebPImagePlugin

    fe = frontend
    data = encoded(500, 300, fmt, exif=_exif(orientation))
    decodes: list[str] = []
    for cls in (ImageFile.ImageFile, WebPImagePlugin.WebPImageFile):
        original = cls.load
        monkeypatch.setattr(
            cls, "load", lambda self, _original=original: decodes.append(self.format) or _original(self)
        )
    image, header = fe.check_image_header(data, "x")
    assert decodes == [], f"the header check decoded a {fmt} image"
    image.load()
    assert decodes, "the decode counter sees nothing: it could not have caught a decode"
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).size
    assert upright == ((300, 500) if orientation >= 5 else (500, 300))
    assert (header.width, header.height) == upright, (fmt, orientation, header)
    prompt = fe.process(user(ImagePart(data)))
    grid = prompt.mm_features[0].data["image_grid_thw"].data[0].tolist()
    assert prompt.mm_features[0].mm_position.length == header.tokens
    # the grid is (frames, rows, columns) of the upright image: 300 wide x 500 high has more rows than columns
    assert (grid[1] > grid[2]) == (orientation >= 5), (fmt, orientation, grid)


def test_a_png_with_exif_behind_its_pixels_is_turned_as_load_image_turns_it(tiny_model_dir, tmp_path):
    """Pillow sees such a chunk only when decoding; the header finds it by walking the chunk headers, so it predicts
    the turned size, and the decode turns the image as load_image does (the header read caches nothing on it)."""
    from transformers.image_utils import load_image

    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels"))
    data = exif_after_pixels(encoded(500, 300, "PNG", exif=_exif(8)))
    assert "exif" not in Image.open(io.BytesIO(data)).info  # really behind the pixels
    _, header = fe.check_image_header(data, "x")
    assert (header.width, header.height) == (300, 500)
    path = tmp_path / "late-exif.png"
    path.write_bytes(data)
    expected = fe.image_processor(images=[load_image(str(path))], return_tensors="pt")
    item = fe.process(user(ImagePart(data))).mm_features[0]
    assert item.data["image_grid_thw"].data.tolist() == expected["image_grid_thw"].tolist()
    assert bool((item.data["pixel_values"].data == expected["pixel_values"]).all())
    assert load_image(str(path)).size == (300, 500)


def test_gif_first_frame_and_other_formats_follow_the_header(tiny_model_dir):
    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels"))
    frames = [Image.new("RGB", (240, 120), (i * 40, 0, 0)) for i in range(3)]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    for data in (gif.getvalue(), encoded(333, 222, "WEBP"), encoded(200, 100, "BMP")):
        _, header = fe.check_image_header(data, "x")
        prompt = fe.process(user(ImagePart(data)))
        assert prompt.mm_features[0].mm_position.length == header.tokens, header


@pytest.mark.parametrize(
    "data, name",
    [(hostile.ico_around(hostile.solid_png(300, 300)), "ICO"), (hostile.tiff(), "TIFF"), (hostile.psd_header(), "PSD")],
)
def test_other_formats_are_refused_by_name_and_never_opened(tiny_model_dir, data, name):
    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels"))
    with pytest.raises(InvalidArgument) as info:
        fe.process(user(ImagePart(data), TextPart("look")))
    message = info.value.message
    for word in (
        f"{name} images are not accepted",
        "JPEG, PNG, WEBP, GIF, BMP",
        "--image-formats",
        "messages[0].content[0].image",
    ):
        assert word in message, message
    assert fe.counts["images_decoded"] == 0 and fe.counts["prompts_tokenized"] == 0
    allowed = (
        Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels", image_formats=f"png,{name.lower()}"))
        if name != "PSD"
        else None
    )
    if allowed is not None:  # the flag lets it through
        assert allowed.process(user(ImagePart(data))).num_images == 1


def test_the_ico_bomb_never_reaches_a_decoder(tiny_model_dir, monkeypatch):
    from PIL import IcoImagePlugin

    def fail(*args, **kwargs):
        raise AssertionError("the ICO plugin ran")

    monkeypatch.setattr(IcoImagePlugin.IcoImageFile, "_open", fail)
    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels"))
    with pytest.raises(InvalidArgument, match="ICO images are not accepted"):
        fe.process(user(ImagePart(hostile.ico_bomb())))
    assert fe.counts["images_decoded"] == 0


def test_png_token_bomb_is_refused_before_decoding_and_a_fitting_one_decodes(tiny_model_dir):
    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels", max_model_len=16384))
    with pytest.raises(InvalidArgument) as info:
        fe.process(user(ImagePart(hostile.png_bomb()), TextPart("what is it?")), reserve_tokens=16)
    for word in (
        "messages[0].content[0].image",
        "5792x5792",
        "16384 prompt tokens",
        "context of 16384",
        "--max-model-len",
    ):
        assert word in info.value.message, info.value.message
    assert fe.counts["images_decoded"] == 0 and fe.counts["prompts_tokenized"] == 0 and fe.cache.used == 0
    # Two images that fit alone but not together are refused for their sum, before either is decoded.
    small = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels", max_model_len=1024))
    two = user(ImagePart(encoded(504, 504)), ImagePart(encoded(504, 505)), TextPart("compare"))
    with pytest.raises(InvalidArgument) as info:
        small.process(two, reserve_tokens=400)
    message = info.value.message
    assert message.startswith("messages[0].content[1].image and sampling.max_tokens: "), message
    for word in ("the 504x505 image takes 324", "up to it 648", "400 to generate", "context of 1024"):
        assert word in message, message
    assert small.counts["images_decoded"] == 0
    assert small.process(two, reserve_tokens=16).num_images == 2
    assert small.counts["images_decoded"] == 2


def test_text_over_the_byte_bound_is_never_tokenized(tiny_model_dir):
    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels", max_model_len=1024))
    assert fe.max_prompt_bytes == 1024 * 8
    with pytest.raises(InvalidArgument) as info:
        fe.process(user(TextPart("a" * 5000), TextPart("漢" * 1200)))
    for word in ("messages[0].content[1].text", "8600 bytes", "8192", "--max-prompt-bytes"):
        assert word in info.value.message, info.value.message
    assert fe.counts["prompts_tokenized"] == 0
    explicit = Frontend(
        tiny_model_dir, SchedulerConfig(payload_encoding="pixels", max_model_len=1024, max_prompt_bytes=100)
    )
    with pytest.raises(InvalidArgument, match="limit is 100 "):
        explicit.process(user(TextPart("x" * 101)))


def test_a_refused_request_leaves_nothing_in_the_processor_cache(tiny_model_dir):
    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels", max_model_len=300))
    turns = user(ImagePart(encoded(224, 224)), TextPart("the quick brown fox jumps " * 45))  # 64 + ~400 tokens
    with pytest.raises(InvalidArgument, match=r"^messages: \d+ prompt tokens \+ 1 to generate"):  # the whole prompt
        fe.process(turns)
    assert fe.counts["images_decoded"] == 1 and fe.cache.used == 0 and len(fe.cache) == 0
    ok = fe.process(user(ImagePart(encoded(224, 224)), TextPart("short")))
    assert len(fe.cache) == 0  # not admitted yet
    fe.commit(ok)
    assert len(fe.cache) == 1 and ok.pending_cache == []


def test_threads_tokenize_concurrently_with_their_own_tokenizers(tiny_model_dir):
    fe = Frontend(tiny_model_dir, SchedulerConfig(payload_encoding="pixels"))
    texts = [f"thread {i}: " + "the lazy dog " * (200 + i) for i in range(6)]
    expected = [fe.process(user(TextPart(t))).token_ids for t in texts]
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i):
        try:
            for _ in range(5):
                got[i] = fe.process(user(TextPart(texts[i]))).token_ids
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [got[i] for i in range(6)] == expected


def test_pending_uploads_are_bounded_per_tenant_and_in_total():
    pending = PendingUploads(total=1000, per_tenant=600)
    pending.reserve("a", 500)
    with pytest.raises(ResourceExhausted, match="--max-pending-upload-bytes-per-tenant"):
        pending.reserve("a", 101)
    pending.reserve("b", 450)
    with pytest.raises(ResourceExhausted, match="server-wide limit is 1000 .--max-pending-upload-bytes."):
        pending.reserve("b", 51)
    assert (pending.total, pending.held("a"), pending.held("b")) == (950, 500, 450)  # refusals counted nothing
    pending.release("a", 500)
    pending.release("b", 450)
    assert pending.total == 0 and pending.held("a") == 0


def test_image_formats_setting_is_validated():
    assert SchedulerConfig(image_formats="jpeg, png").image_formats == ["JPEG", "PNG"]
    with pytest.raises(ValueError, match="image_formats=NOPE unknown to Pillow"):
        SchedulerConfig(image_formats="png,nope")
    with pytest.raises(ValueError, match="image_formats is empty"):
        SchedulerConfig(image_formats=" , ")
