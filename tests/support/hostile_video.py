"""Hostile video files built in memory from the clips of ``tests/video_clips.py`` (nothing binary is committed):
the video cases of the bad-input catalogue (``tests/support/security_catalogue.py``, docs/SECURITY.md).

Each builder is cached and takes well under a second. The MP4 edits work on a clip whose ``moov`` follows its
``mdat`` (PyAV's default), so that growing or shrinking the index moves no sample offset:

- ``h264_claiming(w, h)``: the clip's H.264 sequence parameter set (in ``avcC``), its sample entry (``stsd``) and
  its track header (``tkhd``) rewritten to say ``w`` x ``h``: what FFmpeg's parser reads as the frame size;
- ``many_tracks(n)``: ``n`` more tracks (a ``trak`` holding only its ``tkhd``: 100 bytes each; FFmpeg makes a
  stream of each), or ``n`` copies of the video track without samples (FFmpeg opens a decoder for each);
- ``corrupt_packets()``: the index intact, every sample's bytes replaced by noise;
- ``fewer_frames_than_header()``: a faststart MP4 (index first) whose index counts 20 frames, cut after 12;
- ``frames_change_size()``: a Motion-JPEG AVI whose first 10 frames are 64 x 48 (the size its header and FFmpeg's
  probing give) and whose last 10 are 96 x 64.
"""

from __future__ import annotations

import fractions
import functools
import io
import struct

import numpy as np

from tests.video_clips import make_clip

_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"edts", b"dinf", b"udta"}
_SAMPLE_ENTRIES = {b"avc1": 78}  # bytes of a visual sample entry before its child boxes


def boxes(data: bytes, start: int = 0, end: int | None = None, depth: int = 0):
    """``(depth, offset, size, type)`` of every MP4 box, depth first (32-bit sizes only: the clips are small)."""
    end = len(data) if end is None else end
    i = start
    while i + 8 <= end:
        size, kind = struct.unpack(">I4s", data[i : i + 8])
        if size < 8:
            raise ValueError(f"box {kind!r} at {i} has size {size}")
        yield depth, i, size, kind
        if kind in _CONTAINERS:
            yield from boxes(data, i + 8, i + size, depth + 1)
        elif kind == b"stsd":
            yield from boxes(data, i + 16, i + size, depth + 1)
        elif kind in _SAMPLE_ENTRIES:
            yield from boxes(data, i + 8 + _SAMPLE_ENTRIES[kind], i + size, depth + 1)
        i += size


def _box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I4s", 8 + len(payload), kind) + payload


def _find(data: bytes, kind: bytes) -> tuple[int, int]:
    return next((i, size) for _, i, size, k in boxes(data) if k == kind)


# --- H.264 sequence parameter sets (ITU-T H.264 7.3.2.1.1) ------------------------------------------------------


class _BitReader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def u(self, n: int) -> int:
        value = 0
        for _ in range(n):
            value = (value << 1) | ((self.data[self.pos >> 3] >> (7 - (self.pos & 7))) & 1)
            self.pos += 1
        return value

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
        return (1 << zeros) - 1 + self.u(zeros)


class _BitWriter:
    def __init__(self) -> None:
        self.bits: list[int] = []

    def u(self, n: int, value: int) -> None:
        self.bits += [(value >> (n - 1 - k)) & 1 for k in range(n)]

    def ue(self, value: int) -> None:
        value += 1
        self.u(value.bit_length() - 1, 0)
        self.u(value.bit_length(), value)

    def rbsp(self) -> bytes:
        bits = [*self.bits, 1]  # rbsp_stop_one_bit, then alignment zeros
        bits += [0] * (-len(bits) % 8)
        return bytes(int("".join(map(str, bits[i : i + 8])), 2) for i in range(0, len(bits), 8))


def _unescape(nal: bytes) -> bytes:
    out, zeros = bytearray(), 0
    for b in nal:
        if zeros >= 2 and b == 3:
            zeros = 0
            continue
        out.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return bytes(out)


def _escape(rbsp: bytes) -> bytes:
    out, zeros = bytearray(), 0
    for b in rbsp:
        if zeros >= 2 and b <= 3:
            out.append(3)
            zeros = 0
        out.append(b)
        zeros = zeros + 1 if b == 0 else 0
    return bytes(out)


_HIGH_PROFILES = {100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135}


def resized_sps(nal: bytes, width: int, height: int) -> bytes:
    """The SPS NAL unit ``nal`` saying ``width`` x ``height`` (multiples of 16), without cropping or VUI."""
    r, w = _BitReader(_unescape(nal[1:])), _BitWriter()
    profile = r.u(8)
    w.u(8, profile)
    w.u(8, r.u(8))  # constraint flags
    w.u(8, r.u(8))  # level
    w.ue(r.ue())  # seq_parameter_set_id
    if profile in _HIGH_PROFILES:
        chroma = r.ue()
        w.ue(chroma)
        if chroma == 3:
            w.u(1, r.u(1))
        w.ue(r.ue())  # bit depths
        w.ue(r.ue())
        w.u(1, r.u(1))
        if r.u(1):
            raise ValueError("an SPS with scaling matrices is not rewritten here")
        w.u(1, 0)
    w.ue(r.ue())  # log2_max_frame_num_minus4
    poc = r.ue()
    w.ue(poc)
    if poc == 0:
        w.ue(r.ue())
    elif poc != 2:
        raise ValueError(f"pic_order_cnt_type {poc} is not rewritten here")
    w.ue(r.ue())  # max_num_ref_frames
    w.u(1, r.u(1))  # gaps_in_frame_num_value_allowed_flag
    r.ue(), r.ue()  # the old size
    w.ue(width // 16 - 1)
    w.ue(height // 16 - 1)
    if not r.u(1):
        raise ValueError("an interlaced SPS is not rewritten here")
    w.u(1, 1)  # frame_mbs_only_flag
    w.u(1, r.u(1))  # direct_8x8_inference_flag
    w.u(1, 0)  # no frame cropping
    w.u(1, 0)  # no VUI
    return nal[:1] + _escape(w.rbsp())


@functools.cache
def h264_claiming(width: int, height: int) -> bytes:
    """A 64 x 48 H.264 MP4 whose SPS, sample entry and track header say ``width`` x ``height``."""
    data = make_clip(codec="h264", width=64, height=48, fps=10, frames=4, flat=True)
    i, size = _find(data, b"avcC")
    body = data[i + 8 : i + size]
    if body[5] & 31 != 1:
        raise ValueError("expected one SPS in avcC")
    length = struct.unpack(">H", body[6:8])[0]
    sps = resized_sps(body[8 : 8 + length], width, height)
    new_body = body[:6] + struct.pack(">H", len(sps)) + sps + body[8 + length :]
    delta = len(new_body) - len(body)
    out = bytearray(data[:i] + _box(b"avcC", new_body) + data[i + size :])
    for _, j, s, kind in boxes(data):
        if j < i < j + s:  # an enclosing box grows with avcC (all of them lie before it)
            struct.pack_into(">I", out, j, s + delta)
        if kind == b"avc1":
            struct.pack_into(">HH", out, j + 8 + 24, width, height)
        elif kind == b"tkhd":
            struct.pack_into(">II", out, j + s - 8, width << 16, height << 16)
    return bytes(out)


def _children(data: bytes, start: int, end: int):
    i = start
    while i + 8 <= end:
        size, kind = struct.unpack(">I4s", data[i : i + 8])
        yield i, size, kind
        i += size


def _without_samples(box: bytes) -> bytes:
    """A ``trak`` (or one of its inner boxes) with empty sample tables: no sample, no sync or composition table."""
    kind, payload = box[4:8], b""
    for i, size, child in _children(box, 8, len(box)):
        sub = box[i : i + size]
        if child in (b"mdia", b"minf", b"stbl"):
            payload += _without_samples(sub)
        elif child in (b"stss", b"ctts", b"edts", b"btrt", b"udta"):
            continue
        elif child in (b"stts", b"stsc", b"stco"):
            payload += _box(child, bytes(8))  # version/flags, 0 entries
        elif child == b"stsz":
            payload += _box(child, bytes(12))  # version/flags, sample size 0, 0 entries
        else:
            payload += sub
    return _box(kind, payload)


@functools.cache
def many_tracks(extra: int, decoders: bool = False) -> bytes:
    """A 32 x 32 H.264 MP4 with ``extra`` more tracks: with ``decoders``, copies of its video track without
    samples (~490 bytes each: FFmpeg's probing opens an H.264 decoder for each), else ``trak`` boxes holding only a
    copy of its ``tkhd`` (100 bytes each: still one stream each)."""
    data = make_clip(codec="h264", width=32, height=32, fps=10, frames=4, flat=True)
    i, size = _find(data, b"moov")
    j, trak_size = _find(data, b"trak")
    if decoders:
        trak = _without_samples(data[j : j + trak_size])
    else:
        k, tkhd_size = _find(data, b"tkhd")
        trak = _box(b"trak", data[k : k + tkhd_size])
    return data[:i] + _box(b"moov", data[i + 8 : i + size] + trak * extra) + data[i + size :]


@functools.cache
def truncated() -> bytes:
    """A 64 x 48 H.264 MP4 cut in half: its index (``moov``, at the end) is gone."""
    data = make_clip(codec="h264", width=64, height=48, fps=10, frames=20)
    return data[: len(data) // 2]


@functools.cache
def corrupt_packets() -> bytes:
    """A 64 x 48, 20-frame H.264 MP4 whose index is intact and whose every sample is noise."""
    data = make_clip(codec="h264", width=64, height=48, fps=10, frames=20)
    i, size = _find(data, b"mdat")
    noise = np.random.default_rng(5).integers(0, 256, size - 8, dtype=np.uint8).tobytes()
    return data[: i + 8] + noise + data[i + size :]


@functools.cache
def fewer_frames_than_header() -> bytes:
    """A 64 x 48 H.264 MP4 at 10 fps whose index (first: faststart) counts 20 frames, cut before the 13th."""
    import av

    data = make_clip(codec="h264", width=64, height=48, fps=10, frames=20, faststart=True)
    with av.open(io.BytesIO(data)) as container:
        starts = [p.pos for p in container.demux(video=0) if p.size]
    return data[: starts[12]]


@functools.cache
def frames_change_size() -> bytes:
    """A Motion-JPEG AVI at 10 fps: frames 0-9 are 64 x 48 (the header's size), frames 10-19 are 96 x 64."""
    import av

    buf = io.BytesIO()
    buf.name = "clip.avi"
    with av.open(buf, "w", format="avi") as out:
        stream = out.add_stream("mjpeg", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuvj420p"
        larger = av.CodecContext.create("mjpeg", "w")
        larger.width, larger.height, larger.pix_fmt = 96, 64, "yuvj420p"
        larger.time_base, larger.framerate = fractions.Fraction(1, 10), 10
        for i in range(20):
            w, h = (64, 48) if i < 10 else (96, 64)
            frame = av.VideoFrame.from_ndarray(np.full((h, w, 3), 90 + i, np.uint8), format="rgb24")
            frame = frame.reformat(format="yuvj420p")
            frame.pts = i
            encoder = stream if i < 10 else larger
            for packet in encoder.encode(frame):
                packet.stream, packet.pts, packet.dts = stream, i, i
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@functools.cache
def ten_hours() -> bytes:
    """36 frames of 32 x 32 H.264, one every 1000 s: a 10-hour video in a few kB."""
    return make_clip(codec="h264", width=32, height=32, fps=fractions.Fraction(1, 1000), frames=36, flat=True)


@functools.cache
def other_codec(codec: str = "mpeg2video", container: str = "matroska") -> bytes:
    """Four 32 x 32 frames of ``codec`` (an FFmpeg encoder outside the accepted decoders) in ``container``."""
    import av

    buf = io.BytesIO()
    buf.name = "clip.mkv"
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(4):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 60 * i, np.uint8), format="rgb24")
            for packet in stream.encode(frame.reformat(format="yuv420p")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@functools.cache
def audio_only() -> bytes:
    """An MP4 holding one second of silent AAC and no video stream."""
    return make_clip(audio_only=True, seconds=1)


@functools.cache
def good(frames: int = 20, width: int = 64, height: int = 48, fps: int = 10) -> bytes:
    """A well-formed H.264 MP4."""
    return make_clip(codec="h264", width=width, height=height, fps=fps, frames=frames)
