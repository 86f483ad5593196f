"""One image file -> what the model's processor gives it (common/image_input.py), for both tiny model variants.

- **Bit-equality.** ``ImageInput.process_bytes(file)`` (what a rank runs on an ``encoded`` payload, with the
  processor ``common.processor.load_processor`` gives it) is ``torch.equal`` to transformers' image processor loaded
  from the same folder by ``AutoImageProcessor`` and fed the file as the user sent it. The references never go
  through the project's code:
  - ``processor(images=["data:...;base64,<file>"])``: the processor loads the file itself with transformers'
    ``load_image`` (EXIF orientation applied, then ``convert("RGB")``). That ``convert`` drops an alpha band
    unblended, so it answers for files without one (a palette's transparent index survives it as a colour key,
    which the processor composites).
  - ``processor(images=[Image.open(file)])``: the processor's own ``convert_to_rgb`` composites transparency onto
    white and converts palette, CMYK, 16-bit and 1-bit images. It answers for files that carry no EXIF turn.
  - For turned files, the pixels as stored, turned upright here with numpy by the EXIF rule for the orientation the
    file was written with (not by ``ImageOps``), fed to the processor in the file's own mode: the only reference
    for a file that is both transparent and turned.
  Negative controls show each comparison can fail: dropping the alpha of a transparent file, or ignoring a turn,
  gives other values.
- **Header-only count.** ``ImageInput.grid(header)`` from ``open`` (no pixel decoded) equals the processor's
  ``image_grid_thw`` and ``header.tokens`` its placeholder count, quarter turns included.
- **Failure.** Files of allowed formats that Pillow opens but cannot decode (truncated, a broken zlib stream) raise
  ``InvalidArgument`` naming the field from ``process_bytes``; a format off the whitelist is refused by ``open``,
  naming the format and ``--image-formats``.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import io
import json
import shutil
import struct

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor

from common.errors import InvalidArgument
from common.families import family_of
from common.image_input import ImageInput
from common.model_checks import read_config
from common.processor import load_processor
from scheduler_svc.config import DEFAULT_IMAGE_FORMATS, SchedulerConfig
from tests.support.images import exif_after_pixels

CLAMPED_MAX_PIXELS = 256 * 28 * 28  # a processor max_pixels the downscaled cases exceed (the checkpoint's is 12.8 MP)


@dataclasses.dataclass(frozen=True)
class Case:
    data: bytes  # the file as the user sent it
    orientation: int = 1  # the EXIF orientation it was written with (1: none)
    transparent: bool = False  # some pixel is not fully opaque
    clamped: bool = False  # run against the processor whose max_pixels the image exceeds


def _noise(seed: int, width: int, height: int, channels: int = 3, high: int = 256, dtype=np.uint8) -> np.ndarray:
    shape = (height, width, channels) if channels > 1 else (height, width)
    return np.random.default_rng(seed).integers(0, high, shape, endpoint=False).astype(dtype)


def _alpha(seed: int, width: int, height: int) -> np.ndarray:
    """Opaque, fully transparent and half-transparent pixels: every compositing case."""
    return np.random.default_rng(seed).choice(np.array([0, 0, 128, 255, 255], np.uint8), (height, width))


def _encode(image: Image.Image, fmt: str, orientation: int = 1, **save) -> bytes:
    if orientation != 1:
        exif = Image.Exif()
        exif[0x0112] = orientation
        save["exif"] = exif
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def _rgb(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(_noise(seed, width, height))


def _rgba(seed: int, width: int, height: int) -> Image.Image:
    return Image.fromarray(np.dstack([_noise(seed, width, height), _alpha(seed + 1, width, height)]), "RGBA")


def _palette(seed: int, width: int, height: int) -> Image.Image:
    image = Image.fromarray(_noise(seed, width, height, 1, 16)).convert("P")  # 16 grey levels as palette indices
    image.putpalette(np.random.default_rng(seed + 1).integers(0, 200, 768).astype(np.uint8).tobytes())
    return image


W, H = 90, 62  # the mode cases: a 6x4 grid, 4x6 once turned a quarter
CASE_BUILDERS = {
    # sizes
    "1x1 PNG": lambda: Case(_encode(_rgb(1, 1, 1), "PNG")),
    "5x5 PNG": lambda: Case(_encode(_rgb(2, 5, 5), "PNG")),
    "27x29 PNG": lambda: Case(_encode(_rgb(3, 27, 29), "PNG")),
    "57x113 JPEG": lambda: Case(_encode(_rgb(4, 57, 113), "JPEG", quality=90)),
    "399x2 PNG (aspect 199.5)": lambda: Case(_encode(_rgb(5, 399, 2), "PNG")),
    "2x399 JPEG (aspect 199.5)": lambda: Case(_encode(_rgb(6, 2, 399), "JPEG")),
    "448x448 JPEG": lambda: Case(_encode(_rgb(7, 448, 448), "JPEG", quality=90)),
    "448x448 PNG": lambda: Case(_encode(_rgb(8, 448, 448), "PNG", compress_level=1)),
    "1280x720 JPEG": lambda: Case(_encode(_rgb(9, 1280, 720), "JPEG", quality=90)),
    "720x1280 WebP": lambda: Case(_encode(_rgb(10, 720, 1280), "WEBP", quality=80)),
    "700x500 PNG over max_pixels": lambda: Case(_encode(_rgb(11, 700, 500), "PNG", compress_level=1), clamped=True),
    "4000x60 JPEG over max_pixels": lambda: Case(_encode(_rgb(12, 4000, 60), "JPEG"), clamped=True),
    "450x700 RGBA PNG over max_pixels, EXIF 6": lambda: Case(
        _encode(_rgba(13, 450, 700), "PNG", 6, compress_level=1), 6, True, True
    ),
    # modes
    "RGB PNG": lambda: Case(_encode(_rgb(20, W, H), "PNG")),
    "L PNG": lambda: Case(_encode(Image.fromarray(_noise(21, W, H, 1)), "PNG")),
    "L JPEG": lambda: Case(_encode(Image.fromarray(_noise(22, W, H, 1)), "JPEG")),
    "LA PNG": lambda: Case(
        _encode(Image.fromarray(np.dstack([_noise(23, W, H, 1), _alpha(24, W, H)]), "LA"), "PNG"), transparent=True
    ),
    "RGBA PNG": lambda: Case(_encode(_rgba(25, W, H), "PNG"), transparent=True),
    "RGBA WebP lossless": lambda: Case(_encode(_rgba(27, W, H), "WEBP", lossless=True), transparent=True),
    "P PNG": lambda: Case(_encode(_palette(29, W, H), "PNG")),
    "P PNG with a transparent index": lambda: Case(
        _encode(_palette(31, W, H), "PNG", transparency=5), transparent=True
    ),
    "P GIF": lambda: Case(_encode(_palette(33, W, H), "GIF")),
    "P GIF with a transparent index": lambda: Case(
        _encode(_palette(35, W, H), "GIF", transparency=7), transparent=True
    ),
    "CMYK JPEG": lambda: Case(_encode(Image.fromarray(_noise(37, W, H, 4), "CMYK"), "JPEG", quality=95)),
    "I;16 PNG": lambda: Case(_encode(Image.fromarray(_noise(38, W, H, 1, 60_000, np.uint16)), "PNG")),
    "1-bit PNG": lambda: Case(_encode(Image.fromarray(_noise(39, W, H, 1, 2).astype(bool)), "PNG")),
    "RGB BMP": lambda: Case(_encode(_rgb(40, W, H), "BMP")),
    "RGB WebP": lambda: Case(_encode(_rgb(41, W, H), "WEBP", quality=70)),
    # EXIF orientation
    **{
        f"JPEG EXIF {o}": functools.partial(lambda o: Case(_encode(_rgb(50 + o, W, H), "JPEG", o), o), o)
        for o in range(2, 9)
    },
    "L JPEG EXIF 5": lambda: Case(_encode(Image.fromarray(_noise(60, W, H, 1)), "JPEG", 5), 5),
    "RGB WebP EXIF 8": lambda: Case(_encode(_rgb(61, W, H), "WEBP", 8, quality=70), 8),
    "RGBA PNG EXIF 7": lambda: Case(_encode(_rgba(62, W, H), "PNG", 7), 7, True),
    "CMYK JPEG EXIF 6": lambda: Case(_encode(Image.fromarray(_noise(64, W, H, 4), "CMYK"), "JPEG", 6), 6),
}


@functools.cache
def case(name: str) -> Case:
    return CASE_BUILDERS[name]()


class Kit:
    """One model folder's two processors: the project's (as a rank loads it) and transformers' own."""

    def __init__(self, model_dir) -> None:
        self.reference = AutoImageProcessor.from_pretrained(model_dir)
        self.input = ImageInput(
            load_processor(model_dir).image_processor,
            DEFAULT_IMAGE_FORMATS,
            SchedulerConfig().max_image_pixels,
            family_of(read_config(model_dir)),
        )

    def processed(self, image) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.reference(images=[image], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]


def _clamped_copy(model_dir, tmp_path_factory):
    """The folder with ``max_pixels`` lowered the way older checkpoints spell it (a top-level key beside ``size``)."""
    folder = tmp_path_factory.mktemp("clamped")
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors":  # the processors need no weights
            shutil.copy(path, folder / path.name)
    config = json.loads((folder / "preprocessor_config.json").read_text())
    config["max_pixels"] = CLAMPED_MAX_PIXELS
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=["tiny_model_dir", "tiny_model_25_dir", "tiny_model_q3_dir"])
def kits(request, tmp_path_factory):
    """``{clamped: Kit}`` for one model variant, shared by every case."""
    model_dir = request.getfixturevalue(request.param)
    kits = {False: Kit(model_dir), True: Kit(_clamped_copy(model_dir, tmp_path_factory))}
    assert kits[True].reference.size["longest_edge"] == CLAMPED_MAX_PIXELS
    assert kits[False].reference.size["longest_edge"] > 448 * 448 * 4  # only the clamped cases are downscaled
    return kits


def data_uri(data: bytes) -> str:
    return "data:image/unknown;base64," + base64.b64encode(data).decode()


def upright(pixels: np.ndarray, orientation: int) -> np.ndarray:
    """Stored pixels -> as displayed, by the EXIF rule for each orientation (2-8)."""
    return {
        2: lambda a: a[:, ::-1],  # mirrored left-right
        3: lambda a: a[::-1, ::-1],  # rotated 180
        4: lambda a: a[::-1, :],  # mirrored top-bottom
        5: lambda a: a.swapaxes(0, 1),  # transposed about the main diagonal
        6: lambda a: np.rot90(a, -1),  # turned 90 degrees clockwise to display
        7: lambda a: a.swapaxes(0, 1)[::-1, ::-1],  # transposed about the anti-diagonal
        8: lambda a: np.rot90(a, 1),  # turned 90 degrees counterclockwise to display
    }[orientation](pixels).copy()


def references(kit: Kit, c: Case) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    refs = {}
    if "A" not in Image.open(io.BytesIO(c.data)).getbands():  # a palette's transparent colour survives the convert
        refs["processor(data URI: load_image)"] = kit.processed(data_uri(c.data))
    if c.orientation == 1:
        refs["processor(Image.open(file))"] = kit.processed(Image.open(io.BytesIO(c.data)))
    else:
        stored = Image.open(io.BytesIO(c.data))
        assert stored.mode != "P", "a palette image needs its palette carried over"
        turned = Image.fromarray(upright(np.asarray(stored), c.orientation), stored.mode)
        refs["processor(stored pixels turned by numpy)"] = kit.processed(turned)
    return refs


def opaque(data: bytes) -> Image.Image:
    """The file's colours with its transparency ignored: alpha band dropped, a palette's transparent index cleared."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    image.info.pop("transparency", None)  # convert() carries a palette's transparent index over as a colour key
    return image


CASE_NAMES = list(CASE_BUILDERS)


@pytest.mark.parametrize("name", CASE_NAMES)
def test_process_bytes_equals_the_processor_fed_the_file_as_sent(kits, name):
    c = case(name)
    kit = kits[c.clamped]
    pixels, grid = kit.input.process_bytes(c.data, "messages[0].content[0]")
    assert grid.shape == (1, 3) and grid.dtype == torch.int64
    assert pixels.dtype == torch.float32 and pixels.shape[0] == int(grid.prod())
    refs = references(kit, c)
    assert refs, name
    for what, (ref_pixels, ref_grid) in refs.items():
        assert torch.equal(grid, ref_grid), (name, what, grid.tolist(), ref_grid.tolist())
        assert torch.equal(pixels, ref_pixels), (name, what, float((pixels - ref_pixels).abs().max()))

    # Negative controls: the comparisons above would have caught alpha dropped or a turn ignored.
    if c.transparent:
        assert float((kit.processed(opaque(c.data))[0] - pixels).abs().max()) > 0.5, name
    if c.orientation != 1:
        unturned, unturned_grid = kit.processed(Image.open(io.BytesIO(c.data)))
        assert not torch.equal(unturned_grid, grid) or not torch.equal(unturned, pixels), name
    if c.clamped:  # the checkpoint's processor would not have downscaled it
        _, full = kits[False].processed(Image.open(io.BytesIO(c.data)))
        patch = kit.input.patch_size  # 14, or 16 for Qwen3-VL
        assert int(grid.prod()) <= CLAMPED_MAX_PIXELS // patch**2 < int(full.prod()), (name, grid, full)


def _recording(function, name: str, calls: list[str]):
    def recorded(*args, **kwargs):
        calls.append(name)
        return function(*args, **kwargs)

    return recorded


@pytest.mark.parametrize("name", CASE_NAMES)
def test_header_grid_and_tokens_equal_the_processors(kits, name, monkeypatch):
    from PIL import ImageFile, ImageOps, WebPImagePlugin

    c = case(name)
    kit = kits[c.clamped]
    decodes: list[str] = []
    for owner, attr in [
        (ImageFile.ImageFile, "load"),
        (WebPImagePlugin.WebPImageFile, "load"),
        (ImageOps, "exif_transpose"),
    ]:
        monkeypatch.setattr(owner, attr, _recording(getattr(owner, attr), f"{owner.__name__}.{attr}", decodes))
    _, header = kit.input.open(c.data, "x")
    grid = kit.input.grid(header)
    monkeypatch.undo()
    assert decodes == [], (name, decodes)  # the header alone

    ref = Image.open(io.BytesIO(c.data))
    if c.orientation != 1:
        ref = Image.fromarray(upright(np.asarray(ref), c.orientation), ref.mode)
    _, ref_grid = kit.processed(ref)
    assert (header.width, header.height) == ref.size, (name, header)
    assert grid.dtype == torch.int64 and torch.equal(grid, ref_grid), (name, grid.tolist(), ref_grid.tolist())
    assert header.tokens == int(ref_grid.prod()) // kit.input.merge_size**2, (name, header, ref_grid.tolist())
    assert header.format == Image.open(io.BytesIO(c.data)).format


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _break_zlib(png: bytes) -> bytes:
    """A PNG whose first IDAT chunk carries a corrupted deflate stream (its CRC left wrong too: Pillow does not
    check IDAT CRCs, the inflate is what fails)."""
    at = png.index(b"IDAT")
    (length,) = struct.unpack(">I", png[at - 4 : at])
    out = bytearray(png)
    out[at + 4 + length // 2] ^= 0xFF
    return bytes(out)


CORRUPT = {  # name -> (file, whether Pillow still opens it: then only the decode fails)
    "JPEG cut in half": (lambda: _cut(_encode(_rgb(70, W, H), "JPEG")), True),
    "PNG cut in half": (lambda: _cut(_encode(_rgb(71, W, H), "PNG")), True),
    "PNG with a broken deflate stream": (lambda: _break_zlib(_encode(_rgb(72, W, H), "PNG")), True),
    "GIF cut in half": (lambda: _cut(_encode(_palette(73, W, H), "GIF")), True),
    "BMP cut in half": (lambda: _cut(_encode(_rgb(74, W, H), "BMP")), True),
    "WebP cut in half": (lambda: _cut(_encode(_rgb(75, W, H), "WEBP")), False),  # libwebp refuses it at open
}


@pytest.mark.parametrize("name", list(CORRUPT))
def test_a_corrupt_file_is_invalid_argument_naming_the_field(kits, name):
    build, opens = CORRUPT[name]
    data = build()
    kit = kits[False]
    field = "messages[2].content[1]"
    if opens:  # the header reads: the error can only come from decoding
        _, header = kit.input.open(data, field)
        assert header.tokens > 0
        with pytest.raises(OSError):  # what Pillow itself says about the file
            Image.open(io.BytesIO(data)).load()
    else:
        with pytest.raises(InvalidArgument, match=r"^messages\[2\]\.content\[1\]: .* not a decodable image"):
            kit.input.open(data, field)
    with pytest.raises(InvalidArgument) as error:
        kit.input.process_bytes(data, field)
    message = str(error.value)
    assert message.startswith(field + ": "), message
    if opens:
        assert "could not be decoded" in message and ("truncated" in message or "broken data stream" in message), (
            message
        )


def test_an_exif_chunk_behind_the_pixel_data_is_read_from_the_header(kits):
    """Pillow reads a PNG's eXIf chunk stored after the pixel data only when decoding; the header reader finds it
    without decoding, so the grid the prompt is built from is the turned image's, as load_image turns it."""
    for kit in kits.values():
        data = exif_after_pixels(_encode(_rgb(76, W, H), "PNG", 6))
        _, header = kit.input.open(data, "image")
        pixels, turned_grid = kit.processed(data_uri(data))
        assert turned_grid.tolist() == [[1, W // 14, H // 14]]
        assert torch.equal(kit.input.grid(header), turned_grid)
        got_pixels, got_grid = kit.input.process_bytes(data, "image")
        assert torch.equal(got_grid, turned_grid) and torch.equal(got_pixels, pixels)


def _tiff() -> bytes:
    return _encode(_rgb(80, W, H), "TIFF")


def _ico() -> bytes:
    return _encode(_rgb(81, 32, 32), "ICO")


def _ppm() -> bytes:
    return _encode(_rgb(82, W, H), "PPM")


@pytest.mark.parametrize("fmt, build", [("TIFF", _tiff), ("ICO", _ico), ("PPM", _ppm)])
def test_a_format_off_the_whitelist_is_refused_by_open_naming_it(kits, fmt, build):
    data = build()
    assert Image.open(io.BytesIO(data)).format == fmt  # a real file of that format
    with pytest.raises(InvalidArgument) as error:
        kits[False].input.open(data, "image")
    message = str(error.value)
    assert message.startswith(f"image: {fmt} images are not accepted") and "--image-formats" in message, message


def test_a_narrowed_whitelist_refuses_the_formats_it_leaves_out(kits):
    kit = kits[False]
    png_only = ImageInput(kit.input.image_processor, ["PNG"], SchedulerConfig().max_image_pixels)
    png_only.open(case("RGB PNG").data, "image")
    with pytest.raises(
        InvalidArgument,
        match=r"^image: JPEG images are not accepted; allowed formats: PNG "
        r"\(--image-formats\)",
    ):
        png_only.process_bytes(case("57x113 JPEG").data, "image")
