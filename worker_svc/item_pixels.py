"""An encoded item turned into the pixel fields the vision encoder takes, on the rank that encodes it: an image
through the model's own processor, a video decoded at its planned frames; either way the grid must be the one the
item carries (the prompt and positions were built from it).
"""

from __future__ import annotations

import dataclasses

import torch

from common.errors import InvalidArgument
from common.ids import ItemId
from common.multimodal import (
    ENCODED_FIELD,
    FRAME_INDICES_FIELD,
    VIDEO_ENCODED_FIELD,
    Modality,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    PayloadEncoding,
)


def item_pixels(ident: ItemId, feature, images, videos, grid_field: str | None):
    """The feature with pixel fields: an encoded image decoded and preprocessed by the model's own processor
    (common/image_input.py: ``images``); its grid must be the one the item carries (the prompt was built from it). Raises
    InvalidArgument for a file that fails (the item's failure, not the rank's)."""
    if feature.encoding is not PayloadEncoding.ENCODED:
        return feature
    if feature.modality is Modality.VIDEO:
        return _video_pixels(ident, feature, videos)
    data = feature.data[ENCODED_FIELD].data.numpy().tobytes()
    pixels, grid = images.process_bytes(data, f"item {ident[:16]}")
    fields = {"pixel_values": MultiModalFieldElem(pixels)}
    name = grid_field  # None: a family without a grid (every image one shape)
    if name is not None:
        want = feature.data[name].data.reshape(1, 3)
        if grid is None or not torch.equal(grid, want):
            got = None if grid is None else grid.tolist()[0]
            raise InvalidArgument(
                f"item {ident[:16]}: the decoded image has the grid {got}, its header gave {want.tolist()[0]}"
            )
        fields[name] = feature.data[name]
    return dataclasses.replace(feature, data=MultiModalKwargsItem(fields), encoding=PayloadEncoding.PIXELS)


def _video_pixels(ident: ItemId, feature, videos):
    """An encoded video decoded at the planned frames and preprocessed as the model's video processor does
    (common/video_input.py); the grid it gives must be the item's (the prompt and positions were built from it)."""
    field = f"item {ident[:16]}"
    data = feature.data[VIDEO_ENCODED_FIELD].data.numpy().tobytes()
    grid = feature.data["video_grid_thw"]
    plan = videos.item_plan(data, feature.data[FRAME_INDICES_FIELD].data.tolist(), grid.data, field)
    pixels = videos.process(data, plan, field)
    fields = {"pixel_values_videos": MultiModalFieldElem(pixels), "video_grid_thw": grid}
    return dataclasses.replace(feature, data=MultiModalKwargsItem(fields), encoding=PayloadEncoding.PIXELS)
