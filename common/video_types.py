"""A video's options, limits, header and plan, the resize rule and the video processor's settings: the types
common/video_input.py works with, which the scheduler and the ranks also carry."""

from __future__ import annotations

import dataclasses
import math

import torch

from common.image_header import image_signature

VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"

# FFmpeg demuxer names (``format_whitelist``): no other demuxer runs, so no playlist (HLS, concat) can make FFmpeg
# open another file or a URL.
DEFAULT_FORMATS = ("mov", "mp4", "matroska", "webm", "avi")
# FFmpeg decoder names of the first video stream.
DEFAULT_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")
# Codecs whose FFmpeg parser gives the frame size from the parameter sets (SPS): their header needs no decoded
# frame (``_open``). The others' size comes from the first frame FFmpeg's probing decodes.
SIZE_FROM_PARSER = ("h264", "hevc")

GRID = "video_grid_thw"  # an item's grid field (FRAME_INDICES: its sampled frames, common/multimodal.py)

QWEN2_VL = "Qwen2VLVideoProcessor"  # Qwen2-VL and Qwen2.5-VL
QWEN3_VL = "Qwen3VLVideoProcessor"

# The class defaults of transformers 5.24's video processors: what a setting absent from the file means.
_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
_DEFAULTS = {
    QWEN2_VL: {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": False,
        "fps": None,
        "num_frames": None,
        "image_mean": _CLIP_MEAN,
        "image_std": _CLIP_STD,
        "max_video_tokens": 128000,
    },
    QWEN3_VL: {
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_frames": 4,
        "max_frames": 768,
        "do_sample_frames": True,
        "fps": 2,
        "num_frames": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "max_video_tokens": 768,
    },
}
_COMMON_DEFAULTS = {
    "do_resize": True,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "resample": 3,  # PILImageResampling.BICUBIC
    "cap_pixels_per_frame": None,  # transformers 5.24: None behaves as False (with a warning)
}


@dataclasses.dataclass(frozen=True)
class VideoOptions:
    """The client's sampling options; None: the model's video processor setting.

    ``fps`` and ``num_frames`` exclude each other (as in transformers). ``max_frames`` bounds the ``fps`` rule's
    frame count (Qwen2-VL: the call's ``max_frames``; Qwen3-VL: its ``max_frames`` setting, which its
    ``sample_frames`` reads instead of the call's); an explicit ``num_frames`` is not bounded by it, as in
    transformers. ``min_pixels`` / ``max_pixels``: the resize bounds (``size["shortest_edge"]`` /
    ``size["longest_edge"]``; per frame for Qwen2-VL, over frames x height x width for Qwen3-VL)."""

    fps: float | None = None
    num_frames: int | None = None
    max_frames: int | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclasses.dataclass(frozen=True)
class VideoLimits:
    """Operator limits, checked on the header before anything is decoded. ``FLAGS`` names the option that sets
    each one, for the messages."""

    max_bytes: int = 64 << 20
    max_frame_pixels: int = 1920 * 1080  # width * height of one frame
    max_duration_s: float = 600.0
    max_total_frames: int = 36000  # frames in the file (all may be decoded to reach the last sampled one)
    max_sampled_frames: int = 768  # frames the plan keeps
    max_streams: int = 8

    FLAGS = {  # the scheduler's flags (scheduler_svc/config.py); the ranks receive the same limits in the handshake
        "max_bytes": "--max-upload-bytes",
        "max_frame_pixels": "--max-video-frame-pixels",
        "max_duration_s": "--max-video-seconds",
        "max_total_frames": "--max-video-total-frames",
        "max_sampled_frames": "--max-video-frames",
        "max_streams": "--max-video-streams",
    }

    def describe(self, name: str) -> str:
        """``"<value> (<flag>)"``: a limit as a refusal names it."""
        return f"{getattr(self, name)} ({self.FLAGS[name]})"


@dataclasses.dataclass(frozen=True)
class VideoHeader:
    """The first video stream as the container header gives it (nothing decoded)."""

    width: int  # the coded frame size: the display rotation is not applied (transformers' loader ignores it)
    height: int
    total_frames: int  # stream.frames, or the counted video packets where the header has none
    fps: float  # stream.average_rate
    duration_s: float  # total_frames / fps, as transformers' metadata has it
    codec: str  # FFmpeg's decoder name
    format: str  # FFmpeg's demuxer name(s)
    frames_counted: bool = False  # True: the header had no frame count; total_frames is the packet count


@dataclasses.dataclass(frozen=True)
class VideoPlan:
    """What the processor will produce for a header and options, computed without decoding."""

    frame_indices: tuple[int, ...]  # the frames sample_frames picks (0-based, in decode order)
    grid: torch.Tensor  # video_grid_thw (1, 3) int64
    tokens: int  # placeholder tokens: t * h * w // merge**2
    second_per_grid_t: float  # temporal_patch_size / sampled fps (Qwen2.5-VL's second_per_grid_ts)
    timestamps: tuple[float, ...]  # seconds per temporal patch (Qwen3-VL's "<t seconds>", written with :.1f)
    resized: tuple[int, int]  # (height, width) every frame is resized to
    width: int  # the header's frame size the plan was made for
    height: int

    @property
    def tokens_per_grid_t(self) -> int:
        """Placeholder tokens of one temporal patch (Qwen3-VL writes one block of them per timestamp)."""
        return self.tokens // int(self.grid[0, 0])


def sniffed(data: bytes) -> str:
    """`` (the bytes are a PNG image: ...)`` where ``data`` starts with an image's signature, else ``""``."""
    image = image_signature(data)
    return f" (the bytes are a {image} image: send it as an image part)" if image else ""


def smart_resize_frame(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's ``smart_resize`` (``video_processing_qwen2_vl``): per frame."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_video(
    num_frames: int, height: int, width: int, temporal_factor: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen3-VL's ``smart_resize`` (``video_processing_qwen3_vl``): the bounds are over frames x height x width."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height = int(height * scale)
        width = int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be smaller than 200, got {max(height, width) / min(height, width)}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def processor_settings(raw: dict) -> dict:
    """The effective settings of a ``video_preprocessor_config.json``: the file over its class's defaults, with
    ``min_pixels`` / ``max_pixels`` folded into ``size`` as the processor's ``__init__`` does."""
    kind = raw.get("video_processor_type")
    if kind not in _DEFAULTS:
        raise ValueError(
            f"video_processor_type {kind!r} is not served for video; mmcast serves {', '.join(sorted(_DEFAULTS))}"
        )
    settings = {**_COMMON_DEFAULTS, **_DEFAULTS[kind], **raw}
    size = dict(settings["size"] or _DEFAULTS[kind]["size"])
    if raw.get("min_pixels") is not None:
        size["shortest_edge"] = int(raw["min_pixels"])
    if raw.get("max_pixels") is not None:
        size["longest_edge"] = int(raw["max_pixels"])
    settings["size"] = {"shortest_edge": int(size["shortest_edge"]), "longest_edge": int(size["longest_edge"])}
    if int(settings["resample"]) != 3:
        raise ValueError(f"resample={settings['resample']} is not served; the video path resizes BICUBIC (3) only")
    if settings["fps"] is not None and settings["num_frames"] is not None and settings["do_sample_frames"]:
        raise ValueError("the video processor settings give both fps and num_frames; transformers refuses both")
    settings["video_processor_type"] = kind
    return settings
