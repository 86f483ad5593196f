"""What every model family module builds on: the ``Family`` base class (whose defaults are the Qwen2-VL family's)
and ``config_get``, which reads a transformers config and a ``config.json`` dict alike.

The registry in ``common/families/__init__.py`` imports the family modules, and they import only this module, so
the families and their registry form no import circle. Importing it imports no torch or transformers.
"""

from __future__ import annotations

from typing import Any


def image_only(processor_class):
    """`processor_class` without a video processor, which transformers cannot build without torchvision.

    Same name as the parent, so anything it saves still names the real class.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        # ProcessorMixin takes its sub-processor list from this signature, so `video_processor` is not required.
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(processor_class.__name__, (processor_class,), {"__init__": __init__, "video_processor": None})


def config_get(obj: Any, name: str) -> Any:
    """``obj.name`` for a transformers config, ``obj[name]`` for its ``config.json`` dict; None when absent."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


class Family:
    """The defaults are the Qwen2-VL family's; a family overrides what differs."""

    name: str = ""  # the CLI name (``make-tiny-model --family``)
    model_types: frozenset[str] = frozenset()  # config.json model_type of the whole checkpoint
    text_model_types: frozenset[str] = frozenset()  # model_type of its text_config
    uses_mrope: bool = True  # positions (3, tokens) from every item's grid, cached or not
    grid_field: str | None = "image_grid_thw"  # an image's keep_on_cpu grid field; None: the family has none
    tool_format: str | None = "hermes"  # the tool-call format its chat templates teach (families/tool_calls.py)

    # --- frontend --------------------------------------------------------------------------------------------

    def load_processor_class(self, config):
        """The processor class to load from a model folder when transformers cannot build the full processor
        (no torchvision); ``config`` is the folder's transformers config."""
        from transformers.models.auto.processing_auto import PROCESSOR_MAPPING

        return image_only(PROCESSOR_MAPPING[type(config)])

    def image_grid(self, image_processor, height: int, width: int):
        """``image_grid_thw`` (1, 3) int64 the processor gives an upright image of ``height`` x ``width``; None
        for a family without a grid field."""
        raise NotImplementedError

    def image_tokens(self, processor, image_processor, height: int, width: int) -> int:
        """Placeholder tokens the processor gives an upright image of ``height`` x ``width`` (``processor``: the
        whole processor, or None where only the image processor is known). ValueError where it refuses the size.

        The default is the Qwen-VL rule: the image processor's own patch count over ``merge_size**2``."""
        patches = image_processor.get_number_of_image_patches(height, width)
        return int(patches) // (int(image_processor.merge_size) ** 2)

    def grid_tokens(self, image_processor, grid) -> int:
        """Placeholder tokens of an image whose processed grid is ``grid`` (the family's ``grid_field``)."""
        return int(grid.reshape(-1).prod()) // (int(image_processor.merge_size) ** 2)

    def grid_problem(self, config, grid, grid_name: str) -> str | None:
        """Why an item's grid field (``grid_name``, None when the item has none) is unusable, or None. Checked for
        encoded and pixel payloads alike. The Qwen-VL rule: (t, h, w), positive, h and w multiples of the merge."""
        if grid is None or grid.numel() != 3 or grid.dtype.is_floating_point:
            got = "no such field" if grid is None else f"{grid.dtype}{tuple(grid.shape)}"
            return f"{grid_name} must hold 3 integers (t, h, w); got {got}"
        merge = int(getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) or 1)
        t, h, w = (int(v) for v in grid.reshape(-1).tolist())
        if min(t, h, w) < 1 or h % merge or w % merge:
            return f"{grid_name}=({t}, {h}, {w}) must be positive with h, w multiples of {merge}"
        return None

    def pixel_problem(self, config, pixels, grid, pixels_name: str, grid_name: str) -> str | None:
        """Why a pixel payload ``pixels`` (its grid already passed ``grid_problem``) cannot go through the vision
        tower, or None. The Qwen-VL rule: one row per patch of the grid, each row one patch's values."""
        if pixels.dim() != 2 or not pixels.dtype.is_floating_point:
            return f"{pixels_name} must be a 2-D float tensor; got {pixels.dtype}{tuple(pixels.shape)}"
        t, h, w = (int(v) for v in grid.reshape(-1).tolist())
        if pixels.shape[0] != t * h * w:
            return f"{pixels_name} has {pixels.shape[0]} patch rows; {grid_name}=({t}, {h}, {w}) needs {t * h * w}"
        vision = getattr(config, "vision_config", None)
        channels = getattr(vision, "in_channels", None) or getattr(vision, "in_chans", None)
        try:  # values per patch row: channels x temporal patch x patch x patch
            patch_dim = int(channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        except (AttributeError, TypeError):
            return None  # unknown: not checked
        if pixels.shape[1] != patch_dim:
            return f"{pixels_name} rows have {pixels.shape[1]} values; the vision tower takes {patch_dim}"
        return None

    # --- positions -------------------------------------------------------------------------------------------

    def rope_kwargs(self, config) -> dict[str, Any]:
        """Keyword arguments of ``mrope_positions`` besides the prompt and its items."""
        return {}

    # --- encoder and language model --------------------------------------------------------------------------

    def row_width(self, config, hidden: int) -> int:
        """Values in one encoder-output row (what the encoder cache and the group's broadcast hold)."""
        return hidden

    def encode(self, model, pixels, grid, video: bool):
        """The rows ``[placeholder tokens, row_width]`` of one item."""
        raise NotImplementedError

    def text_model_kwargs(self, hidden: int, length: int, indices, rows) -> dict[str, Any]:
        """Extra keyword arguments of the text model for a packed sequence of ``length`` tokens whose tokens at
        ``indices`` (1-D, ascending) take the encoder ``rows`` (same order); the first ``hidden`` values of a row
        replace the token's embedding (the runner does that for every family)."""
        return {}

    def tp_plan(self, model_config, tp: int) -> dict[str, str] | None:
        """A tensor-parallel plan to load the checkpoint with, or None for the checkpoint's own."""
        return None
