"""Deterministic synthetic video: a camera panning across a synthetic landscape, cut into short h264 MP4 segments.

The video demo and the video benchmarks need clips that decode like camera footage (smooth motion, one keyframe
per segment) without shipping any media. A wide scene from ``synthetic_images.synthetic_scene`` is rendered once;
frame ``i`` of the stream is the window of ``size`` starting ``speed * i`` pixels from its left edge, so consecutive
segments continue one another the way the segments of a live stream do. Each segment is its own MP4 file (its own
header and keyframe), as a live assistant receives them; the same seed gives the same frames and, with the same
PyAV, the same bytes.
"""

from __future__ import annotations

import fractions
import functools
import io

import numpy as np

DEFAULT_SIZE = (320, 180)  # (width, height) of a frame
DEFAULT_FPS = 8  # frames per second of the stream
SEGMENT_SECONDS = 2.0
PAN_PIXELS_PER_FRAME = 3


@functools.lru_cache(maxsize=4)
def _panorama(seed: int, size: tuple[int, int], frames: int) -> np.ndarray:
    """The scene the camera pans across: wide enough for ``frames`` frames at the pan speed, RGB uint8."""
    from mmcast_local.synthetic_images import synthetic_scene

    width, height = size
    wide = width + PAN_PIXELS_PER_FRAME * frames
    return np.asarray(synthetic_scene(seed, (wide, height)).convert("RGB"))


def stream_frames(seed: int, start: int, count: int, size: tuple[int, int] = DEFAULT_SIZE) -> np.ndarray:
    """Frames ``start .. start + count - 1`` of stream ``seed``: (count, height, width, 3) uint8."""
    width, _ = size
    scene = _panorama(seed, size, max(1024, start + count))
    left = [PAN_PIXELS_PER_FRAME * i for i in range(start, start + count)]
    return np.stack([scene[:, x : x + width] for x in left])


def encode_mp4(frames: np.ndarray, fps: int = DEFAULT_FPS) -> bytes:
    """The frames as one h264 (libx264, yuv420p) MP4 file, one keyframe at its start."""
    import av

    out = io.BytesIO()
    height, width = frames.shape[1:3]
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fractions.Fraction(fps, 1))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"preset": "veryfast", "crf": "28", "g": str(len(frames))}
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def stream_segment(
    seed: int,
    index: int,
    *,
    seconds: float = SEGMENT_SECONDS,
    fps: int = DEFAULT_FPS,
    size: tuple[int, int] = DEFAULT_SIZE,
) -> bytes:
    """Segment ``index`` (0-based) of stream ``seed``: ``seconds`` of it as an MP4 file."""
    per_segment = max(1, round(seconds * fps))
    return encode_mp4(stream_frames(seed, index * per_segment, per_segment, size), fps)


def synthetic_clip(seed: int, *, seconds: float = 4.0, fps: int = DEFAULT_FPS, size: tuple[int, int] = DEFAULT_SIZE):
    """A whole clip of ``seconds`` (the video agent's file)."""
    return stream_segment(seed, 0, seconds=seconds, fps=fps, size=size)
