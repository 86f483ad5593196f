"""Small synthetic video files made in code with PyAV (FFmpeg inside the wheel), for the video tests.

``make_clip`` encodes ``frames`` frames of a deterministic moving pattern (a gradient, a bar that moves a few pixels a
frame and the frame number as a block pattern, so a wrong frame index or a wrong frame order shows in the pixels) and
returns the file's bytes. Options cover what the preprocessing must handle: codec and container (h264/mp4,
vp9/webm, mjpeg/avi or mkv, hevc/mp4, mpeg4), odd sizes, frame rates, a display rotation written as the stream's
display matrix, an audio stream beside the video, extra video streams, audio alone. Keep clips small (<= 160x120,
<= 3 s): the oracle decodes every one of them again.

``CODECS`` lists the (codec, container) pairs this PyAV build can encode; ``clip_corpus`` is the tests' standard set.
"""

from __future__ import annotations

import dataclasses
import fractions
import io
import os
import tempfile

import numpy as np

# codec -> (container format, pixel format); the file suffix is the container's usual one.
CODECS = {
    "h264": ("mp4", "yuv420p"),  # libx264
    "vp9": ("webm", "yuv420p"),  # libvpx-vp9
    "mjpeg": ("avi", "yuvj420p"),
    "hevc": ("mp4", "yuv420p"),  # libx265
    "mpeg4": ("mkv", "yuv420p"),
}
_ENCODER = {"h264": "libx264", "vp9": "libvpx-vp9", "hevc": "libx265", "mjpeg": "mjpeg", "mpeg4": "mpeg4"}
_SUFFIX = {"mp4": ".mp4", "webm": ".webm", "avi": ".avi", "matroska": ".mkv", "mkv": ".mkv", "mov": ".mov"}


def available(codec: str) -> bool:
    """Whether this PyAV build has the encoder of ``codec``."""
    import av

    try:
        av.codec.Codec(_ENCODER[codec], "w")
    except Exception:  # noqa: BLE001 - UnknownCodecError and friends: not built in
        return False
    return True


def frame_pattern(index: int, width: int, height: int, seed: int = 0) -> np.ndarray:
    """RGB uint8 (height, width, 3) of frame ``index``: smooth enough to survive lossy codecs, different every frame."""
    y, x = np.mgrid[0:height, 0:width]
    r = (x * 255 // max(1, width - 1) + 7 * index + 31 * seed) % 256
    g = (y * 255 // max(1, height - 1) + 3 * index) % 256
    b = ((x + y) * 2 + 11 * index + 17 * seed) % 256
    img = np.stack([r, g, b], axis=-1).astype(np.uint8)
    bar = (4 * index) % max(1, width)  # a vertical bar moving right
    img[:, bar : bar + 3] = (255, 255, 255)
    for bit in range(8):  # the frame number as 8 black/white blocks along the top
        color = 255 if (index >> bit) & 1 else 0
        img[0 : min(6, height), bit * 6 : bit * 6 + 5] = color
    return img


def make_clip(
    *,
    codec: str = "h264",
    width: int = 96,
    height: int = 64,
    fps: int | fractions.Fraction = 24,
    frames: int | None = None,
    seconds: float = 1.0,
    container: str | None = None,
    rotation: int | None = None,
    audio: bool = False,
    video_streams: int = 1,
    audio_only: bool = False,
    seed: int = 0,
    pix_fmt: str | None = None,
    flat: bool = False,
    faststart: bool = False,
) -> bytes:
    """The bytes of a video file (see the module docstring). ``frames`` defaults to ``round(seconds * fps)``.

    ``rotation``: degrees counter-clockwise written as the stream's display matrix (what phones write; ``ffprobe``
    shows it as side data ``rotation``). ``video_streams``: that many video streams, each of the same frames.
    ``audio``: a silent AAC stream beside the video; ``audio_only``: no video stream at all. ``pix_fmt``: the
    encoded pixel format (libx264 takes odd sizes only in 4:4:4, ``yuv444p``). ``flat``: mid-gray frames (fast to
    make and encode at large sizes). ``faststart``: an MP4's index (``moov``) before the frames, so a file cut short
    still has a header that counts every frame."""
    import av

    fmt, default_pix_fmt = CODECS[codec]
    fmt = container or fmt
    pix_fmt = pix_fmt or default_pix_fmt
    if fmt == "mkv":
        fmt = "matroska"
    count = int(frames if frames is not None else round(seconds * float(fps)))
    if faststart:  # the muxer's second pass reopens the file by name: a real file
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "clip.mp4")
            _encode(av.open(path, mode="w", format=fmt, options={"movflags": "faststart"}), **_args(locals()))
            with open(path, "rb") as f:
                return f.read()
    buf = io.BytesIO()
    buf.name = "clip" + _SUFFIX.get(fmt, ".bin")
    _encode(av.open(buf, mode="w", format=fmt), **_args(locals()))
    return buf.getvalue()


def _args(scope: dict) -> dict:
    names = ("codec", "width", "height", "fps", "count", "rotation", "audio", "video_streams", "audio_only", "seed")
    return {name: scope[name] for name in (*names, "pix_fmt", "flat", "seconds")}


def _encode(
    out, *, codec, width, height, fps, count, rotation, audio, video_streams, audio_only, seed, pix_fmt, flat, seconds
) -> None:
    import av

    with out:
        streams = []
        if not audio_only:
            for _ in range(video_streams):
                stream = out.add_stream(_ENCODER[codec], rate=fractions.Fraction(fps))
                stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
                if codec == "h264":
                    stream.options = {"preset": "ultrafast", "crf": "18", "bf": "2", "g": "12"}
                elif codec == "hevc":
                    stream.options = {"preset": "ultrafast", "x265-params": "log-level=error"}
                elif codec == "vp9":
                    stream.options = {"deadline": "realtime", "cpu-used": "8", "crf": "20", "b": "0"}
                if rotation:
                    stream.set_display_rotation(rotation)
                streams.append(stream)
        sound = None
        if audio or audio_only:
            sound = out.add_stream("aac", rate=16000)
            sound.layout = "mono"
        for i in range(count if not audio_only else 0):
            pixels = np.full((height, width, 3), 128, np.uint8) if flat else frame_pattern(i, width, height, seed)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for stream in streams:
                for packet in stream.encode(frame.reformat(format=pix_fmt)):
                    out.mux(packet)
        for stream in streams:
            for packet in stream.encode():
                out.mux(packet)
        if sound is not None:
            samples = int(16000 * (count / float(fps) if not audio_only else seconds))
            step = 1024
            for start in range(0, samples, step):
                n = min(step, samples - start)
                chunk = av.AudioFrame.from_ndarray(np.zeros((1, n), dtype=np.float32), format="fltp", layout="mono")
                chunk.sample_rate, chunk.pts = 16000, start
                for packet in sound.encode(chunk):
                    out.mux(packet)
            for packet in sound.encode():
                out.mux(packet)


@dataclasses.dataclass(frozen=True)
class Clip:
    name: str  # also its file name, with the container's suffix
    data: bytes
    width: int
    height: int
    frames: int
    fps: float


def clip_corpus() -> list[Clip]:
    """The standard set: h264/mp4 at several sizes (odd ones too), frame rates 10/24/30 and durations 1-3 s, one with a
    display rotation, one with audio; vp9/webm, mjpeg/avi, hevc/mp4 and mpeg4/mkv where this PyAV build encodes
    them."""
    specs = [
        ("h264_96x64_24fps_1s", {"codec": "h264", "width": 96, "height": 64, "fps": 24, "seconds": 1}),
        ("h264_160x120_30fps_2s", {"codec": "h264", "width": 160, "height": 120, "fps": 30, "seconds": 2}),
        (
            "h264_75x53_10fps_3s",
            {"codec": "h264", "width": 75, "height": 53, "fps": 10, "seconds": 3, "pix_fmt": "yuv444p"},
        ),
        ("h264_120x40_24fps_17f", {"codec": "h264", "width": 120, "height": 40, "fps": 24, "frames": 17}),
        (
            "h264_rot90_80x48_10fps",
            {"codec": "h264", "width": 80, "height": 48, "fps": 10, "seconds": 1, "rotation": 90},
        ),
        (
            "h264_audio_64x64_10fps",
            {"codec": "h264", "width": 64, "height": 64, "fps": 10, "seconds": 2, "audio": True},
        ),
        ("vp9_100x60_24fps_1s", {"codec": "vp9", "width": 100, "height": 60, "fps": 24, "seconds": 1}),
        ("mjpeg_63x47_10fps_2s", {"codec": "mjpeg", "width": 63, "height": 47, "fps": 10, "seconds": 2}),
        ("hevc_96x72_30fps_1s", {"codec": "hevc", "width": 96, "height": 72, "fps": 30, "seconds": 1}),
        ("mpeg4_88x66_10fps_2s", {"codec": "mpeg4", "width": 88, "height": 66, "fps": 10, "seconds": 2}),
    ]
    clips = []
    for name, spec in specs:
        if not available(spec["codec"]):
            continue
        data = make_clip(**spec)
        fmt = spec.get("container") or CODECS[spec["codec"]][0]
        frames = spec.get("frames") or round(spec["seconds"] * spec["fps"])
        suffix = _SUFFIX.get(fmt, ".bin")
        clips.append(Clip(name + suffix, data, spec["width"], spec["height"], frames, float(spec["fps"])))
    return clips
