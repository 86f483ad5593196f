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

import io
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch

from common.errors import InvalidArgument
from common.image_header import reason
from common.video_frames import FrameDecoding
from common.video_items import EncodedItems
from common.video_types import (
    DEFAULT_CODECS,
    DEFAULT_FORMATS,
    QWEN3_VL,
    SIZE_FROM_PARSER,
    VIDEO_PROCESSOR_FILE,
    VideoHeader,
    VideoLimits,
    VideoOptions,
    VideoPlan,
    processor_settings,
    smart_resize_frame,
    smart_resize_video,
    sniffed,
)

__all__ = ["VideoHeader", "VideoInput", "VideoLimits", "VideoOptions", "VideoPlan"]


class VideoInput(FrameDecoding, EncodedItems):
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
        self.settings = processor_settings(settings)
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
        if not video or video[0].codec_context.name in SIZE_FROM_PARSER:
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
                f"({', '.join(self.formats)}){sniffed(data)}: {reason(exc)}",
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
