"""Image files built for tests."""

from __future__ import annotations


def exif_after_pixels(png: bytes) -> bytes:
    """``png`` with its eXIf chunk moved behind the pixel data (allowed by the PNG spec; Pillow sees it on load)."""
    chunks, pos = [], 8
    while pos < len(png):
        size = int.from_bytes(png[pos : pos + 4], "big")
        chunks.append(png[pos : pos + 12 + size])
        pos += 12 + size
    exif = [c for c in chunks if c[4:8] == b"eXIf"]
    rest = [c for c in chunks if c[4:8] != b"eXIf"]
    assert len(exif) == 1 and rest[-1][4:8] == b"IEND"
    return png[:8] + b"".join(rest[:-1]) + exif[0] + rest[-1]
