"""What an image will cost, read from its header alone: format, size and prompt tokens, before any pixel is decoded.

- **Format whitelist.** ``Image.open(fp, formats=allowed)`` runs only the allowed plugins' header parsers; any other
  plugin never runs (PIL's ICO plugin, for one, decodes the embedded image inside ``Image.open``). A refused file is
  named by the first other plugin whose magic-byte check (``accept``) matches its first bytes, without opening it.
- **Pixels.** ``width * height`` against ``--max-image-pixels`` (decompression bombs).
- **Tokens.** The placeholder count follows from the header size and the processor's own resize rule (the model
  family's ``image_tokens``, ``common/families/``; for the Qwen-VL families ``get_number_of_image_patches``:
  transformers' ``smart_resize`` with the processor's patch size, merge size and min/max pixels, divided by
  ``merge_size**2``; for LLaVA a constant, the processor's count for its fixed crop);
  ``tests/scheduler/test_image_header.py`` compares it with the processor's output. A GIF, APNG or animated WebP counts its first frame, the only one decoded.
- **Orientation.** The frontend turns an image upright as transformers' ``load_image`` does
  (``ImageOps.exif_transpose``), so an EXIF orientation of 5-8 (a quarter turn, with or without a mirror) swaps the
  width and height the processor sees; the header's width and height are those. The tag is read from the metadata
  Pillow parsed at open (JPEG APP1, WebP EXIF/XMP chunks, PNG eXIf/text chunks before the pixel data): no pixel is
  decoded. A PNG's eXIf chunk that follows its pixel data (Pillow reads it only when decoding) is found by walking
  the chunk headers, without decompressing anything.
"""

from __future__ import annotations

import dataclasses
import io
import re
import warnings
from collections.abc import Sequence

from common.errors import InvalidArgument

_PREFIX_BYTES = 16  # what Pillow's accept() functions look at
_ORIENTATION_TAG = 0x0112
_QUARTER_TURNS = (5, 6, 7, 8)  # transpose, rotate 270, transverse, rotate 90: width and height trade places


# Signatures of the common image and video files, only to tell a client that sent one as the other what it sent.
_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", 0, "PNG"),
    (b"\xff\xd8\xff", 0, "JPEG"),
    (b"GIF8", 0, "GIF"),
    (b"WEBP", 8, "WEBP"),
    (b"BM", 0, "BMP"),
)
_VIDEO_MAGIC = (
    (b"ftyp", 4, "MP4"),
    (b"moov", 4, "MP4"),
    (b"\x1a\x45\xdf\xa3", 0, "Matroska/WebM"),
    (b"AVI ", 8, "AVI"),
)


def _magic(data: bytes, table) -> str | None:
    return next((name for magic, at, name in table if data[at : at + len(magic)] == magic), None)


def image_signature(data: bytes) -> str | None:
    """``"PNG"``, ``"JPEG"``, ...: the image format whose signature ``data`` starts with (nothing is parsed)."""
    return _magic(data, _IMAGE_MAGIC)


def video_signature(data: bytes) -> str | None:
    """``"MP4"``, ``"Matroska/WebM"`` or ``"AVI"``: the video container whose signature ``data`` starts with."""
    return _magic(data, _VIDEO_MAGIC)


def reason(exc: BaseException) -> str:
    """An exception as a client may see it: its type and text, without object reprs (they hold heap addresses)."""
    text = re.sub(r"<[^<>]* at 0x[0-9a-fA-F]+>", "the data", str(exc))[:200]
    return f"{type(exc).__name__}: {text}"


@dataclasses.dataclass(frozen=True)
class ImageHeader:
    format: str  # Pillow's format name (one of the allowed ones)
    width: int  # pixels, as the processor will see them: first frame of an animation, EXIF orientation applied
    height: int
    tokens: int  # placeholder tokens the processor will give this image


class ImageHeaderReader:
    """Opens encoded images lazily with the allowed plugins only and predicts their prompt tokens."""

    def __init__(self, formats: Sequence[str], max_pixels: int, image_processor, tokens_of=None) -> None:
        from PIL import Image

        Image.init()
        self.formats = tuple(formats)
        self.max_pixels = max_pixels
        self.image_processor = image_processor
        # (height, width) -> placeholder tokens: the model family's rule (common/families/); by default Qwen-VL's.
        self._tokens_of = tokens_of
        # Other plugins' magic-byte checks, only to name a refused format in the error.
        self._others = [
            (name, accept)
            for name, (_, accept) in Image.OPEN.items()
            if name not in self.formats and accept is not None
        ]

    def tokens(self, width: int, height: int) -> int:
        """Placeholder tokens of a ``width`` x ``height`` image (ValueError where the processor refuses the size)."""
        if self._tokens_of is not None:
            return self._tokens_of(height, width)
        patches = self.image_processor.get_number_of_image_patches(height, width)
        return int(patches) // (int(self.image_processor.merge_size) ** 2)

    def detect(self, data: bytes) -> str | None:
        """The name of a not-allowed format whose signature matches ``data`` (no plugin is opened)."""
        prefix = data[:_PREFIX_BYTES]
        for name, accept in self._others:
            try:
                if accept(prefix):
                    return name
            except Exception:  # noqa: BLE001 - a signature check that fails on short input just does not match
                continue
        return None

    def _refuse_format(self, data: bytes, field: str, exc: BaseException):
        detected = self.detect(data)
        allowed = ", ".join(self.formats)
        if detected is not None:
            raise InvalidArgument(
                f"{field}: {detected} images are not accepted; allowed formats: {allowed} (--image-formats)",
                field=field,
            ) from None
        video = video_signature(data)
        hint = f" (the bytes are an {video} video: send it as a video part)" if video else ""
        raise InvalidArgument(
            f"{field}: {len(data)} bytes are not a decodable image of an allowed format ({allowed}, "
            f"--image-formats){hint}: {reason(exc)}",
            field=field,
        ) from None

    def open(self, data: bytes, field: str):
        """``(image, header)``: the image opened lazily (nothing decoded), its header checked against every limit
        except the context (which needs the whole request)."""
        from PIL import Image

        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the check below is ours
                image = Image.open(io.BytesIO(data), formats=self.formats)
        except Image.DecompressionBombError as exc:  # PIL's own, far higher limit: the header claims a bomb
            pixels = re.search(r"\((\d+) pixels\)", str(exc))
            claimed = f"{pixels.group(1)} pixels" if pixels else f"over {2 * Image.MAX_IMAGE_PIXELS} pixels"
            raise InvalidArgument(
                f"{field}: image header claims {claimed}; the limit is {self.max_pixels} (--max-image-pixels)",
                field=field,
            ) from None
        except Exception as exc:  # PIL raises many types for bad input
            self._refuse_format(data, field, exc)
        width, height = image.size
        if orientation(image, data) in _QUARTER_TURNS:
            width, height = height, width
        if width < 1 or height < 1:
            raise InvalidArgument(f"{field}: image is {width}x{height}; both sides must be >= 1 pixel", field=field)
        if width * height > self.max_pixels:
            raise InvalidArgument(
                f"{field}: image is {width}x{height} = {width * height} pixels; the limit is "
                f"{self.max_pixels} (--max-image-pixels)",
                field=field,
            )
        try:
            tokens = self.tokens(width, height)
        except ValueError as exc:  # e.g. an aspect ratio the resize rule refuses
            raise InvalidArgument(
                f"{field}: the {width}x{height} image cannot be preprocessed ({reason(exc)})", field=field
            ) from None
        return image, ImageHeader(image.format or "", width, height, tokens)


def _png_exif_chunk(data: bytes) -> bytes | None:
    """The data of a PNG's eXIf chunk wherever it sits, by walking the chunk headers (length, type): nothing is
    decompressed. None when there is none or the chunk list is malformed before one is found."""
    pos = 8  # after the signature
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        kind = data[pos + 4 : pos + 8]
        if kind == b"eXIf":
            return data[pos + 8 : pos + 8 + length]
        if kind == b"IEND":
            return None
        pos += 12 + length  # length, type, data, CRC
    return None


def orientation(image, data: bytes) -> int:
    """The EXIF orientation (1-8) of a lazily opened ``image`` as ``ImageOps.exif_transpose`` reads it, without
    decoding pixels; 1 when the file has none or its metadata is unreadable (the decode then fails or agrees)."""
    from PIL import Image

    try:
        late = _png_exif_chunk(data) if image.format == "PNG" and "exif" not in image.info else None
        if late is not None:
            # PngImageFile.getexif would decode the whole image to reach an eXIf chunk behind the pixel data; the
            # chunk is read here from the file, as Pillow's decode would then read it (it wins over text chunks).
            exif = Image.Exif()
            exif.load(late)
        elif image.format == "PNG" and "exif" not in image.info:
            # No eXIf chunk: the base class reads what was parsed at open (text chunks, XMP), on a second, throwaway
            # opening so the image the frontend decodes keeps no cached answer and exif_transpose later reads the
            # file as it is.
            exif = Image.Image.getexif(Image.open(io.BytesIO(data), formats=("PNG",)))
        else:
            exif = image.getexif()
        value = int(exif.get(_ORIENTATION_TAG, 1))
    except Exception:  # noqa: BLE001 - malformed metadata: no turn predicted
        return 1
    return value if 1 <= value <= 8 else 1
