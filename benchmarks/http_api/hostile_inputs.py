"""Hostile inputs built in memory, fast and small (nothing binary is committed): the decompression bombs of
docs/SECURITY.md, used by the security benchmark (``benchmarks/http_api/security_load.py``) and the bad-input catalogue.

A solid-colour image compresses ~1000:1 under deflate, so a PNG of W x H pixels is written row by row through one
``zlib.compressobj`` (no W x H buffer ever exists): the 13000 x 13000 grey bomb takes ~1.5 s to build, once per
process (cached).
"""

from __future__ import annotations

import functools
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def solid_png(width: int, height: int, *, rgb: bool = True, value: int = 0x5A) -> bytes:
    """A valid PNG of ``width`` x ``height`` pixels of one colour (8-bit RGB, or grey with ``rgb=False``)."""
    channels = 3 if rgb else 1
    row = b"\x00" + bytes([value]) * (width * channels)  # filter byte 0 + the row's samples
    z = zlib.compressobj(9)
    parts = [z.compress(row) for _ in range(height)]
    parts.append(z.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2 if rgb else 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", b"".join(parts)) + _chunk(b"IEND", b"")


def ico_around(png: bytes) -> bytes:
    """An ICO file with one entry holding ``png`` (the entry's own 1-byte sizes say 256: ICO cannot say more;
    Pillow's ICO plugin decodes the embedded PNG at its real size inside ``Image.open``)."""
    header = struct.pack("<HHH", 0, 1, 1)  # reserved, type 1 = icon, one image
    entry = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 6 + 16)
    return header + entry + png


@functools.cache
def ico_bomb(side: int = 13000) -> bytes:
    """The ICO bomb of issue 13: a ``side`` x ``side`` image (~194 kB for 13000: 169 MB of grey pixels, 507 MB
    once converted to RGB) in an .ico."""
    return ico_around(solid_png(side, side, rgb=False))


@functools.cache
def png_bomb(side: int = 5792) -> bytes:
    """A solid ``side`` x ``side`` grey PNG (5792^2 = 33.5 MP, inside the default --max-image-pixels; ~33 kB)."""
    return solid_png(side, side, rgb=False)


def psd_header() -> bytes:
    """The first bytes of a Photoshop file (signature, version 1, 3 channels, 64 x 64, 8 bits, RGB)."""
    return b"8BPS" + struct.pack(">H6xHIIHH", 1, 3, 64, 64, 8, 3) + bytes(64)


def tiff(width: int = 64, height: int = 64) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(out, format="TIFF")
    return out.getvalue()
