"""Decoding a video's planned frames and preprocessing them as the model's video processor does (torch and PyAV
alone): part of ``VideoInput`` (common/video_input.py), whose module docstring gives the rules."""

from __future__ import annotations

import torch

from common.errors import InvalidArgument
from common.image_header import reason
from common.video_types import VideoPlan


class FrameDecoding:
    """The decoding and preprocessing of ``VideoInput`` (mixed into it; its attributes are the input's)."""

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
