"""An encoded video item as a rank receives it: its sampled frames and grid checked against the file's header
before anything is decoded. Part of ``VideoInput`` (common/video_input.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from common.errors import InvalidArgument
from common.multimodal import FRAME_INDICES_FIELD as FRAME_INDICES
from common.video_types import GRID, QWEN3_VL, VideoHeader, VideoOptions, VideoPlan


class EncodedItems:
    """The rank's side of ``VideoInput.plan`` (mixed into it)."""

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
