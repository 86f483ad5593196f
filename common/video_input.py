"""One video file -> what the model's video processor gives it, with torch and PyAV alone: no torchvision.

transformers 5.24's video processors (``Qwen2VLVideoProcessor``, which Qwen2.5-VL uses too, and
``Qwen3VLVideoProcessor``) import torchvision, which the product venv does not have. This module is their pipeline
re-done for a container file (MP4, WebM, Matroska, AVI), equal to transformers fed the same file
(tests/common/test_video_input.py compares it with transformers itself, run in the oracle venv of
``scripts/install-oracle-venv.sh``):

- ``probe``: the container header only (PyAV ``open``, the demuxers of ``formats`` only, nothing decoded but what
  FFmpeg's stream probing reads): the first video stream's codec (``codecs``), coded size, frame count and frame
  rate, checked against ``VideoLimits`` before anything is decoded. The metadata is what transformers' PyAV loader
  reads (``read_video_pyav``: ``stream.frames``, ``stream.average_rate``, duration = frames / rate). Where the header
  has no frame count (``stream.frames`` 0: WebM and Matroska write none) that loader fails (it divides by zero while
  sampling); here the video packets are counted instead (demuxed, not decoded) and the count is the frame count.
- ``plan``: the frames ``sample_frames`` picks (the family's rule, the client's ``VideoOptions`` over the model's
  settings), the resized frame size (``smart_resize``), ``video_grid_thw``, the placeholder count,
  ``second_per_grid_t`` (Qwen2.5-VL's ``second_per_grid_ts``) and the temporal patches' timestamps (Qwen3-VL's
  ``<t seconds>``) - from the header alone.
- ``process``: decodes the frames in order, stops after the last planned one and converts only the planned ones
  to RGB uint8 exactly as the loader does (``frame.to_ndarray(format="rgb24")``), so at most the sampled frames are
  ever held; every decoded frame must have the header's size and the planned frames must all exist (else the header
  lied: ``InvalidArgument``). Then transformers' steps with torch ops: BICUBIC resize as torchvision's
  ``tvF.resize`` does it for the uint8 tensors the processor passes (on CPU it calls ``interpolate(uint8,
  mode="bicubic", align_corners=False, antialias=True)`` directly: torch's native uint8 kernel, rounding inside it),
  the fused rescale and normalize (mean and std divided by the rescale factor, in float32), the last frame repeated
  up to a multiple of ``temporal_patch_size``, and the patch layout: ``pixel_values_videos`` (rows, patch_dim)
  float32, bit-equal to transformers'.

Rotation: transformers' loader ignores a display rotation (``to_ndarray`` gives the coded frame, FFmpeg's decoder
applies no display matrix), so this module ignores it too: a phone video with a 90 degree display matrix is seen
sideways, as transformers sees it, and its header size is the coded size.

Rules of the module: every refusal is ``InvalidArgument`` naming the field, the value and the limit (with the
``VideoLimits`` field or the option that sets it); every limit is checked on the header before the cost it bounds is
paid; nothing decodes more frames than ``max_total_frames`` or keeps more than ``max_sampled_frames``, and the
decoder itself refuses a frame over twice ``max_frame_pixels`` (FFmpeg's ``max_pixels``), so a stream that changes
its frame size mid-stream costs at most one such frame before it is refused. FFmpeg's stream probing inside ``open``
(``avformat_find_stream_info``) may decode a frame before the header's size is known; that one frame is the cost of
reading any header.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from common.errors import InvalidArgument
from common.image_header import image_signature, reason
from common.multimodal import FRAME_INDICES_FIELD as FRAME_INDICES

__all__ = ["VideoHeader", "VideoInput", "VideoLimits", "VideoOptions", "VideoPlan"]

VIDEO_PROCESSOR_FILE = "video_preprocessor_config.json"

# FFmpeg demuxer names (``format_whitelist``): no other demuxer runs, so no playlist (HLS, concat) can make FFmpeg
# open another file or a URL.
DEFAULT_FORMATS = ("mov", "mp4", "matroska", "webm", "avi")
# FFmpeg decoder names of the first video stream.
DEFAULT_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mjpeg")
# Codecs whose FFmpeg parser gives the frame size from the parameter sets (SPS): their header needs no decoded
# frame (``_open``). The others' size comes from the first frame FFmpeg's probing decodes.
_SIZE_FROM_PARSER = ("h264", "hevc")

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


def _sniffed(data: bytes) -> str:
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


def _settings(raw: dict) -> dict:
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


class VideoInput:
    """Header checks, frame sampling, grid prediction and preprocessing for one model's video processor."""

    def __init__(
        self,
        settings: dict,
        limits: VideoLimits | None = None,
        family=None,
        formats: Sequence[str] = DEFAULT_FORMATS,
        codecs: Sequence[str] = DEFAULT_CODECS,
    ) -> None:
        """``settings``: the model folder's ``video_preprocessor_config.json`` as a dict (its
        ``video_processor_type`` chooses the rules). ``family``: the model family (``common/families/``), kept for
        the caller; the rules follow the video processor class, which Qwen2-VL and Qwen2.5-VL share."""
        self.settings = _settings(settings)
        self.kind = self.settings["video_processor_type"]
        self.limits = VideoLimits() if limits is None else limits
        self.family = family
        self.formats = tuple(formats)
        self.codecs = tuple(codecs)
        s = self.settings
        self.patch_size = int(s["patch_size"])
        self.merge_size = int(s["merge_size"])
        self.temporal_patch_size = int(s["temporal_patch_size"])

    @classmethod
    def from_model_dir(cls, model_dir, limits: VideoLimits | None = None, family=None, **kwargs) -> VideoInput:
        """From ``<model_dir>/video_preprocessor_config.json``; ``FileNotFoundError`` when the folder has none."""
        path = Path(model_dir) / VIDEO_PROCESSOR_FILE
        return cls(json.loads(path.read_text()), limits, family, **kwargs)

    # --- the header ---------------------------------------------------------------------------------------------

    def _refuse(self, field: str, what: str, name: str):
        raise InvalidArgument(f"{field}: {what}; the limit is {self.limits.describe(name)}", field=field)

    def _open(self, data: bytes, field: str):
        """The container opened for reading, FFmpeg's stream probing (``avformat_find_stream_info``) bounded:

        - ``max_streams``: the demuxer makes at most one stream over the limit (probing opens a decoder for each,
          ~300 kB for H.264: 500 empty video tracks in 250 kB would cost 157 MB before the count is checked);
        - ``skip_frame=all`` where the codec's parser reads the frame size from its parameter sets (H.264, HEVC):
          probing decodes nothing, so an SPS claiming 16000 x 16000 costs no frame buffer (otherwise ~670 MB and
          a second, before the size check refuses it);
        - ``max_pixels``: the codecs whose size only a decoded frame gives (Motion-JPEG, VP9, MPEG-4 part 2) decode
          one frame while probing; one over twice ``max_frame_pixels`` fails in the decoder before it is allocated
          (the header then has no size: refused below, naming the limit).

        The first open skips every frame; where the first video stream's codec needs a decoded frame for its size,
        the file is opened again without skipping (both opens read the header only)."""
        limits = self.limits
        options = {
            "format_whitelist": ",".join(self.formats),
            "max_streams": str(limits.max_streams + 1),
            "max_pixels": str(min(2 * limits.max_frame_pixels, 2**31 - 1)),
        }
        container = self._open_with(data, field, {**options, "skip_frame": "all"})
        video = container.streams.video
        if not video or video[0].codec_context.name in _SIZE_FROM_PARSER:
            return container
        container.close()
        return self._open_with(data, field, options)

    def _open_with(self, data: bytes, field: str, options: dict):
        import av

        try:
            return av.open(io.BytesIO(data), mode="r", options=options)
        except MemoryError:  # ENOMEM: what the MP4 and AVI demuxers answer to a stream past max_streams
            self._refuse(
                field,
                "FFmpeg stopped reading the container: it declares more streams than the limit (or a table too "
                "large to allocate)",
                "max_streams",
            )
        except Exception as exc:  # noqa: BLE001 - PyAV raises many types for bad input
            raise InvalidArgument(
                f"{field}: {len(data)} bytes are not a readable video container of an allowed format "
                f"({', '.join(self.formats)}){_sniffed(data)}: {reason(exc)}",
                field=field,
            ) from None

    def probe(self, data: bytes, field: str) -> VideoHeader:
        """The header of the first video stream, every limit checked; nothing decoded."""
        limits = self.limits
        if len(data) > limits.max_bytes:
            self._refuse(field, f"the video is {len(data)} bytes", "max_bytes")
        with self._open(data, field) as container:
            return self._header(container, field)

    def _header(self, container, field: str) -> VideoHeader:
        limits = self.limits
        streams = len(container.streams)
        if streams > limits.max_streams:  # _open lets the demuxer make one stream over the limit, no more
            self._refuse(field, f"the container has more than {limits.max_streams} streams", "max_streams")
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise InvalidArgument(
                f"{field}: the container has no video stream (streams: {', '.join(kinds)})", field=field
            )
        stream = container.streams.video[0]
        codec = stream.codec_context.name if stream.codec_context is not None else ""
        if codec not in self.codecs:
            raise InvalidArgument(
                f"{field}: video codec {codec or 'unknown'!r} is not accepted; allowed codecs: {', '.join(self.codecs)}",
                field=field,
            )
        width, height = int(stream.width or 0), int(stream.height or 0)
        if width < 1 or height < 1:  # none, or one FFmpeg refused while probing (max_pixels, its own bound)
            self._refuse(
                field,
                f"the video's frame size could not be read ({width}x{height} after FFmpeg's probing): its first "
                "frame is over twice the limit (refused before it is decoded) or past FFmpeg's own bound of about "
                "2^28 pixels, or the stream gives none",
                "max_frame_pixels",
            )
        if width * height > limits.max_frame_pixels:
            self._refuse(field, f"video frames are {width}x{height} = {width * height} pixels", "max_frame_pixels")
        rate = stream.average_rate
        fps = float(rate) if rate else 0.0
        if not (fps > 0 and math.isfinite(fps)):
            raise InvalidArgument(f"{field}: the video header gives no frame rate", field=field)
        if container.duration is not None and container.duration / 1e6 > limits.max_duration_s:
            self._refuse(field, f"the video lasts {container.duration / 1e6:.1f} s", "max_duration_s")
        total = int(stream.frames or 0)
        counted = False
        if total == 0:
            total, counted = self._count_packets(container, stream, field), True
        if total > limits.max_total_frames:
            self._refuse(field, f"the video has {total} frames", "max_total_frames")
        if total < 1:
            raise InvalidArgument(f"{field}: the video stream has no frame", field=field)
        duration = total / fps
        if duration > limits.max_duration_s:
            self._refuse(field, f"the video lasts {duration:.1f} s ({total} frames at {fps:g} fps)", "max_duration_s")
        return VideoHeader(width, height, total, fps, duration, codec, container.format.name, counted)

    def _count_packets(self, container, stream, field: str) -> int:
        """Video packets of ``stream`` (demuxed, not decoded), for a header without a frame count; stops past the
        frame limit."""
        count = 0
        try:
            for packet in container.demux(stream):
                if packet.size:
                    count += 1
                    if count > self.limits.max_total_frames:
                        break
        except Exception as exc:  # noqa: BLE001 - a damaged file: its frames cannot be counted
            raise InvalidArgument(
                f"{field}: the video header gives no frame count and its packets cannot be read ({reason(exc)})",
                field=field,
            ) from None
        return count

    # --- the plan -----------------------------------------------------------------------------------------------

    def _options(self, options: VideoOptions, field: str) -> dict:
        """The effective sampling and size settings of a request: the options over the model's settings."""
        s = self.settings
        o = options
        if o.fps is not None and o.num_frames is not None:
            raise InvalidArgument(
                f"{field}: fps={o.fps} and num_frames={o.num_frames} exclude each other; give one", field=field
            )
        if o.fps is not None and not (isinstance(o.fps, int | float) and math.isfinite(o.fps) and o.fps > 0):
            raise InvalidArgument(f"{field}: fps={o.fps!r} must be a positive number", field=field)
        for name in ("num_frames", "max_frames", "min_pixels", "max_pixels"):
            value = getattr(o, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidArgument(f"{field}: {name}={value!r} must be a positive integer", field=field)
        if o.num_frames is not None:
            fps, num_frames = None, o.num_frames
        elif o.fps is not None:
            fps, num_frames = float(o.fps), None
        else:
            fps, num_frames = s["fps"], s["num_frames"]
        size = dict(s["size"])
        if o.min_pixels is not None:
            size["shortest_edge"] = o.min_pixels
        if o.max_pixels is not None:
            size["longest_edge"] = o.max_pixels
        if size["shortest_edge"] > size["longest_edge"]:
            raise InvalidArgument(
                f"{field}: min_pixels={size['shortest_edge']} exceeds max_pixels={size['longest_edge']}", field=field
            )
        return {
            "fps": fps,
            "num_frames": num_frames,
            "min_frames": int(s["min_frames"]),
            "max_frames": int(o.max_frames if o.max_frames is not None else s["max_frames"]),
            "size": size,
        }

    def _sample(self, header: VideoHeader, eff: dict, field: str) -> list[int]:
        total, tps = header.total_frames, self.temporal_patch_size
        if not self.settings["do_sample_frames"]:
            return list(range(total))
        fps, num_frames = eff["fps"], eff["num_frames"]
        what = f"num_frames={num_frames}" if num_frames is not None else f"fps={fps}"
        if self.kind == QWEN3_VL:  # Qwen3VLVideoProcessor.sample_frames
            import numpy as np

            if num_frames is None and fps is not None:
                num_frames = int(total / header.fps * fps)
                num_frames = min(max(num_frames, eff["min_frames"]), eff["max_frames"], total)
            if num_frames is None:
                num_frames = min(max(total, eff["min_frames"]), eff["max_frames"])
            self._check_sampled(num_frames, what, field)
            if num_frames > total:
                raise InvalidArgument(
                    f"{field}: {what} asks for {num_frames} frames; the video has {total}", field=field
                )
            return [int(i) for i in np.linspace(0, total - 1, num_frames).round().astype(int)]
        # Qwen2VLVideoProcessor.sample_frames
        if num_frames is not None:
            num_frames = round(num_frames / tps) * tps
        elif fps is not None:
            max_frames = math.floor(min(eff["max_frames"], total) / tps) * tps
            n = total / header.fps * fps
            n = min(max(n, eff["min_frames"]), max_frames, total)
            num_frames = math.floor(n / tps) * tps
        else:
            raise InvalidArgument(
                f"{field}: the model samples video frames but sets neither fps nor num_frames; give one", field=field
            )
        self._check_sampled(num_frames, what, field)
        if num_frames > total:
            raise InvalidArgument(f"{field}: {what} asks for {num_frames} frames; the video has {total}", field=field)
        if num_frames < 1:
            raise InvalidArgument(
                f"{field}: {what} samples no frame of the {total}-frame video (frames are taken in multiples of "
                f"temporal_patch_size {tps})",
                field=field,
            )
        return torch.arange(0, total, total / num_frames).int().tolist()

    def _check_sampled(self, num_frames: int, what: str, field: str) -> None:
        if num_frames > self.limits.max_sampled_frames:  # before "the video has N": the limit is the answer
            self._refuse(field, f"{what} asks for {num_frames} sampled frames", "max_sampled_frames")

    def plan(self, header: VideoHeader, options: VideoOptions | None, field: str) -> VideoPlan:
        """The sampled frames, grid, placeholder count and temporal metadata for ``header`` under ``options``."""
        eff = self._options(options or VideoOptions(), field)
        indices = self._sample(header, eff, field)
        frames = len(indices)
        if frames > self.limits.max_sampled_frames:
            self._refuse(field, f"the video would be sampled to {frames} frames", "max_sampled_frames")
        if len(set(indices)) != frames:  # not reachable with the rules above; the loader would drop duplicates
            raise InvalidArgument(f"{field}: the sampled frames repeat ({frames} frames)", field=field)
        tps, patch, merge = self.temporal_patch_size, self.patch_size, self.merge_size
        size = eff["size"]
        try:
            if not self.settings["do_resize"]:
                resized = (header.height, header.width)
            elif self.kind == QWEN3_VL:
                resized = smart_resize_video(
                    frames,
                    header.height,
                    header.width,
                    tps,
                    patch * merge,
                    size["shortest_edge"],
                    self._max_pixels(size, frames, patch * merge, tps),
                )
            else:
                resized = smart_resize_frame(
                    header.height,
                    header.width,
                    patch * merge,
                    size["shortest_edge"],
                    self._max_pixels(size, frames, patch * merge, tps),
                )
        except ValueError as exc:
            raise InvalidArgument(
                f"{field}: the {header.width}x{header.height} video cannot be preprocessed ({reason(exc)})",
                field=field,
            ) from None
        grid_t = (frames + -frames % tps) // tps
        grid = torch.tensor([[grid_t, resized[0] // patch, resized[1] // patch]], dtype=torch.int64)
        tokens = int(grid.prod()) // merge**2
        sampled_fps = frames / header.total_frames * header.fps  # VideoMetadata.sampled_fps
        return VideoPlan(
            frame_indices=tuple(indices),
            grid=grid,
            tokens=tokens,
            second_per_grid_t=tps / sampled_fps,
            timestamps=tuple(self._timestamps(indices, header.fps)),
            resized=resized,
            width=header.width,
            height=header.height,
        )

    def _max_pixels(self, size: dict, frames: int, factor: int, tps: int) -> int:
        """The resize's upper bound with ``cap_pixels_per_frame`` (the family's rule) or without it."""
        longest, shortest = size["longest_edge"], size["shortest_edge"]
        if not self.settings["cap_pixels_per_frame"]:
            return longest
        tokens = int(self.settings["max_video_tokens"])
        if self.kind == QWEN3_VL:
            per_frame = max(min(tokens * factor * factor, longest // frames), int(shortest * 1.05))
            return per_frame * frames
        total_pixels = int(tokens * factor * factor * 0.9)
        return max(min(longest, total_pixels * tps // frames), int(shortest * 1.05))

    def _timestamps(self, indices: list[int], fps: float) -> list[float]:
        """``Qwen3VLProcessor._calculate_timestamps``: the last index repeated up to a multiple of the temporal
        patch, then the mean of each patch's first and last frame time."""
        tps = self.temporal_patch_size
        indices = list(indices)
        if len(indices) % tps:
            indices.extend(indices[-1] for _ in range(tps - len(indices) % tps))
        times = [i / fps for i in indices]
        return [(times[i] + times[i + tps - 1]) / 2 for i in range(0, len(times), tps)]

    def placeholder_text(
        self,
        plan: VideoPlan,
        video_token: str = "<|video_pad|>",
        vision_start: str = "<|vision_start|>",
        vision_end: str = "<|vision_end|>",
    ) -> str:
        """What the processor writes in place of the one ``video_token`` the chat template gives a video: Qwen2-VL's
        processor repeats it ``plan.tokens`` times; Qwen3-VL's writes, per temporal patch, ``"<{t:.1f} seconds>"``
        then ``vision_start``, the patch's tokens and ``vision_end`` (inside the template's own start and end)."""
        if self.kind != QWEN3_VL:
            return video_token * plan.tokens
        per = plan.tokens_per_grid_t
        return "".join(f"<{t:.1f} seconds>{vision_start}{video_token * per}{vision_end}" for t in plan.timestamps)

    # --- decoding and preprocessing -----------------------------------------------------------------------------

    def decode(self, data: bytes, plan: VideoPlan, field: str) -> torch.Tensor:
        """The planned frames as RGB uint8 ``(frames, height, width, 3)``, decoded in order up to the last one."""
        import numpy as np

        wanted = set(plan.frame_indices)
        last = max(plan.frame_indices)
        frames = []
        with self._open(data, field) as container:
            header = self._header(container, field)
            if (header.width, header.height) != (plan.width, plan.height):
                raise InvalidArgument(
                    f"{field}: the video header gives {header.width}x{header.height} frames; the plan was made for "
                    f"{plan.width}x{plan.height}",
                    field=field,
                )
            container.seek(0)
            # FFmpeg's own bound on one frame: a stream whose size grows mid-stream (a new SPS) fails in the decoder
            # before it allocates a frame far over the limit; twice the limit leaves room for the coded alignment
            # (1080 lines are coded as 1088). The exact check is the size comparison below.
            container.streams.video[0].codec_context.options = {"max_pixels": str(2 * self.limits.max_frame_pixels)}
            try:
                for i, frame in enumerate(container.decode(video=0)):
                    if i > last:
                        break
                    if (frame.width, frame.height) != (header.width, header.height):
                        raise InvalidArgument(
                            f"{field}: frame {i} decodes to {frame.width}x{frame.height} but the video header gives "
                            f"{header.width}x{header.height} (the header lies); re-encode the video",
                            field=field,
                        )
                    if i in wanted:
                        frames.append(frame.to_ndarray(format="rgb24"))
                    del frame
            except InvalidArgument:
                raise
            except Exception as exc:  # noqa: BLE001 - FFmpeg's decoding errors
                raise InvalidArgument(
                    f"{field}: the video could not be decoded after {len(frames)} of its {len(wanted)} sampled "
                    f"frames ({reason(exc)})",
                    field=field,
                ) from None
        if len(frames) != len(wanted):
            raise InvalidArgument(
                f"{field}: the video decodes to fewer frames than its header gives ({header.total_frames}): frame "
                f"{sorted(wanted)[len(frames)]} of the sampled ones is missing (the header lies); re-encode the video",
                field=field,
            )
        return torch.from_numpy(np.stack(frames)).contiguous()

    def preprocess(self, frames: torch.Tensor, plan: VideoPlan) -> torch.Tensor:
        """``pixel_values_videos`` of decoded RGB uint8 frames ``(frames, height, width, 3)``: the video
        processor's resize, rescale and normalize, temporal padding and patch layout."""
        s = self.settings
        video = frames.permute(0, 3, 1, 2).contiguous()  # _prepare_input_videos: channels first
        if s["do_resize"]:
            video = _resize_bicubic(video, plan.resized)
        if s["do_rescale"] and s["do_normalize"]:  # _fuse_mean_std_and_rescale_factor, then tvF.normalize
            mean = torch.tensor(s["image_mean"]) * (1.0 / s["rescale_factor"])
            std = torch.tensor(s["image_std"]) * (1.0 / s["rescale_factor"])
            video = video.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
        elif s["do_normalize"]:
            mean = torch.as_tensor(s["image_mean"], dtype=torch.float32).view(-1, 1, 1)
            std = torch.as_tensor(s["image_std"], dtype=torch.float32).view(-1, 1, 1)
            video = video.to(torch.float32).sub_(mean).div_(std)
        elif s["do_rescale"]:
            video = video * s["rescale_factor"]
        return self._patchify(video)

    def _patchify(self, video: torch.Tensor) -> torch.Tensor:
        tps, patch, merge = self.temporal_patch_size, self.patch_size, self.merge_size
        frames, channel, height, width = video.shape
        if pad := -frames % tps:  # the last frame repeated
            video = torch.cat((video, video[-1:].expand(pad, -1, -1, -1)), dim=0)
            frames += pad
        grid_t, grid_h, grid_w = frames // tps, height // patch, width // patch
        patches = video.view(
            1, grid_t, tps, channel, grid_h // merge, merge, patch, grid_w // merge, merge, patch
        ).permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
        return patches.reshape(grid_t * grid_h * grid_w, channel * tps * patch * patch)

    def process(self, data: bytes, plan: VideoPlan, field: str) -> torch.Tensor:
        """``pixel_values_videos`` (rows, patch_dim) float32 of the file ``plan`` was made for; decodes only up to
        the last planned frame and keeps only the planned ones."""
        if len(data) > self.limits.max_bytes:
            self._refuse(field, f"the video is {len(data)} bytes", "max_bytes")
        pixels = self.preprocess(self.decode(data, plan, field), plan)
        rows = int(plan.grid.prod())
        if pixels.shape[0] != rows:  # not reachable: the frames have the header's size
            raise InvalidArgument(
                f"{field}: the video gives {pixels.shape[0]} patch rows; its grid needs {rows}", field=field
            )
        return pixels

    def item_problem(
        self, frame_indices: Sequence[int], grid: torch.Tensor, placeholder_tokens: int | None
    ) -> str | None:
        """Why an encoded video item's plan cannot be right whatever its file holds, or None: what a rank checks
        before it opens the file. ``frame_indices``: the item's ``video_frame_indices``; ``grid``: its
        ``video_grid_thw`` (already positive with h, w multiples of the merge: ``Family.grid_problem``);
        ``placeholder_tokens``: the tokens its prompt position takes (None: not checked)."""
        n, limit = len(frame_indices), self.limits
        if not 1 <= n <= limit.max_sampled_frames:
            return f"{FRAME_INDICES} has {n} frames; the limit is 1 to {limit.describe('max_sampled_frames')}"
        previous = -1
        for k, index in enumerate(frame_indices):
            if index <= previous:
                return (
                    f"{FRAME_INDICES}[{k}]={index} follows {previous}: the sampled frames must be strictly "
                    "increasing from 0 (the order they decode in)"
                )
            previous = index
        t, h, w = (int(v) for v in grid.reshape(-1).tolist())
        tps = self.temporal_patch_size
        if t != -(-n // tps):
            return (
                f"{GRID}=({t}, {h}, {w}) has {t} temporal patches; {n} frames make {-(-n // tps)} "
                f"(temporal_patch_size {tps})"
            )
        tokens = t * h * w // self.merge_size**2
        if placeholder_tokens is not None and tokens != placeholder_tokens:
            return (
                f"{GRID}=({t}, {h}, {w}) gives {tokens} placeholder tokens; the item's position takes "
                f"{placeholder_tokens}"
            )
        return None

    def _grid_fits(self, header: VideoHeader, h: int, w: int) -> bool:
        """Whether a grid of ``h`` x ``w`` patches is a size the resize rule can give the header's frames under
        some ``min_pixels`` / ``max_pixels``: each side is its scaled length rounded, floored or ceiled to the
        resize factor (``smart_resize``), one scale for both, so ``side * scale / factor`` lies within one of the
        grid's count for the same scale."""
        patch, factor = self.patch_size, self.patch_size * self.merge_size
        height, width = header.height, header.width
        if not self.settings["do_resize"]:
            return (h * patch, w * patch) == (height, width)
        if self.kind == QWEN3_VL and (height < factor or width < factor):  # its smart_resize scales these up first
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        low, high = 0.0, math.inf
        for side, count in ((height, h * patch // factor), (width, w * patch // factor)):
            low = max(low, (count - 1) * factor / side)  # the clamp of a floored side to one factor: count 1
            high = min(high, (count + 1) * factor / side)
        return low < high

    def item_plan(self, data: bytes, frame_indices, grid: torch.Tensor, field: str) -> VideoPlan:
        """The plan of an encoded item as the scheduler made it: its sampled frames and its grid, checked against
        this file's header (the owner rank's side of ``plan``: the frames are the item's, not re-derived). The
        header checks (``probe``) and these come before any frame is decoded."""
        header = self.probe(data, field)
        indices = tuple(int(i) for i in frame_indices)
        t, h, w = (int(v) for v in grid.reshape(-1).tolist())
        problem = self.item_problem(indices, grid, None)
        if problem is None and indices[-1] >= header.total_frames:
            problem = (
                f"{FRAME_INDICES} asks for frame {indices[-1]}; the video has {header.total_frames} frames (its header)"
            )
        if problem is None and not self._grid_fits(header, h, w):
            problem = (
                f"{GRID}=({t}, {h}, {w}) resizes frames to {w * self.patch_size}x{h * self.patch_size}, which the "
                f"resize rule cannot give the {header.width}x{header.height} video"
            )
        if problem is not None:
            raise InvalidArgument(f"{field}: {problem}", field=field)
        resized = (h * self.patch_size, w * self.patch_size)
        tokens = t * h * w // (self.merge_size**2)
        return VideoPlan(
            indices, grid.reshape(1, 3).to(torch.int64), tokens, 0.0, (), resized, header.width, header.height
        )

    def process_bytes(self, data: bytes, options: VideoOptions | None, field: str, grid: torch.Tensor | None = None):
        """``(pixel_values_videos, plan)``: probe, plan and process, what a rank does with an encoded payload;
        ``grid``: the grid the prompt was built with, which the plan must equal."""
        plan = self.plan(self.probe(data, field), options, field)
        if grid is not None and not torch.equal(plan.grid.reshape(1, 3), grid.reshape(1, 3).to(torch.int64)):
            raise InvalidArgument(
                f"{field}: the video's grid is {tuple(plan.grid[0].tolist())} but the item carries "
                f"{tuple(grid.reshape(-1).tolist())}",
                field=field,
            )
        return self.process(data, plan, field), plan

    # --- identity -----------------------------------------------------------------------------------------------

    def settings_key(self, options: VideoOptions | None = None) -> dict:
        """The effective settings of a request that change its tokens, positions or pixels (for the item
        identifier's hash): the video processor's settings with the options applied. JSON-serialisable."""
        eff = self._options(options or VideoOptions(), "options")
        s = self.settings
        key = {
            name: s[name]
            for name in (
                "video_processor_type",
                "patch_size",
                "temporal_patch_size",
                "merge_size",
                "do_sample_frames",
                "min_frames",
                "do_resize",
                "resample",
                "do_rescale",
                "rescale_factor",
                "do_normalize",
                "image_mean",
                "image_std",
                "max_video_tokens",
            )
        }
        key["image_mean"], key["image_std"] = list(key["image_mean"]), list(key["image_std"])
        key["cap_pixels_per_frame"] = bool(s["cap_pixels_per_frame"])
        key.update(eff)
        return key


def _resize_bicubic(video: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``tvF.resize(video, size, BICUBIC, antialias=True)`` for a uint8 ``(frames, 3, h, w)`` tensor on CPU:
    torchvision's ``resize_image`` keeps uint8 for BICUBIC on CPU and calls torch's antialiased kernel directly
    (its restride of a single channels-last image only changes the output's memory layout, kept here too)."""
    from torch.nn.functional import interpolate

    frames, channels, height, width = video.shape
    if (height, width) == tuple(size) or video.numel() == 0:
        return video
    strides = video.stride()
    if video.is_contiguous(memory_format=torch.channels_last) and frames == 1 and video.numel() != strides[0]:
        video = video.as_strided((1, channels, height, width), [video.numel(), *strides[1:]])
    return interpolate(video, size=list(size), mode="bicubic", align_corners=False, antialias=True)
