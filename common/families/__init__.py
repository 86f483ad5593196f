"""Model families: the one place per family that says how mmcast serves it, chosen from ``config.json``'s
``model_type``.

A family answers the questions whose answer differs between model generations while the scheduler's decisions and
the wire stay the same (docs/ARCHITECTURE.md §2.8):

- ``model_types``: the ``model_type`` values of its checkpoints (and of their text parts);
- ``load_processor_class``: the processor class to load from the folder when torchvision is missing;
- ``grid_field``: the name of an image's grid field (``image_grid_thw``), or None for a family whose processor
  gives none (a fixed-size family: every image is the same tensor shape and the same number of tokens);
- ``image_tokens`` / ``image_grid`` / ``grid_tokens``: the header-only frontend's rules, image size -> the
  placeholder count and the grid the processor will produce, and a processed grid -> its placeholder count;
- ``uses_mrope`` / ``rope_kwargs``: whether positions are M-RoPE (then a stripped item keeps its ``keep_on_cpu``
  grids, which positions need, and ``common.mrope.mrope_positions`` takes these parameters); otherwise
  positions are 1-D (``arange``) and a prefix-covered item keeps no field at all;
- ``grid_problem`` / ``pixel_problem``: the rank's shape checks of an item before the encoder runs;
- ``encode``: the vision tower's call, giving one row per placeholder token (``row_width`` values a row);
- ``text_model_kwargs``: how encoder rows enter the language model besides replacing the placeholder embeddings;
- ``tp_plan``: the tensor-parallel plan for the decoder when the checkpoint's own does not shard it;
- ``tool_format``: how its checkpoints write tool calls (``common/families/tool_calls.py``), None for none.

Every module of this package defines one ``Family`` subclass and registers an instance in ``FAMILIES``.
Importing this package imports no torch or transformers: ``common/model_checks.py`` reads ``config.json`` with it
in milliseconds.
"""

from __future__ import annotations

from typing import Any


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

        from common.processor import image_only

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


def _families() -> tuple[Family, ...]:
    from common.families import llava, qwen2_vl, qwen3_vl

    return (*qwen2_vl.FAMILIES, *qwen3_vl.FAMILIES, *llava.FAMILIES)


def all_families() -> tuple[Family, ...]:
    """Every family mmcast serves, in the order of the README's table."""
    return _families()


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for f in _families() for t in sorted(f.model_types))


def family_for_type(model_type: str | None) -> Family | None:
    """The family whose checkpoints (or text parts) have ``model_type``; None when mmcast serves none."""
    for family in _families():
        if model_type in family.model_types or model_type in family.text_model_types:
            return family
    return None


def family_of(config: Any) -> Family:
    """The family of a transformers config or a ``config.json`` dict; ``ValueError`` naming the type otherwise."""
    model_type = config_get(config, "model_type")
    family = family_for_type(model_type)
    if family is None:
        raise ValueError(f"model type {model_type!r} is not served; mmcast serves {', '.join(supported_model_types())}")
    return family


def family_named(name: str) -> Family:
    """The family of a CLI name (``qwen2-vl``, ``qwen3-vl``, ``llava``, ...)."""
    for family in _families():
        if family.name == name:
            return family
    raise ValueError(f"family {name!r}; choose one of {[f.name for f in _families()]}")


# --- whether positions are M-RoPE: the one rule the scheduler and the ranks share ---------------------------------
# The answer decides two things that must agree across processes: the scheduler keeps the ``keep_on_cpu`` fields
# (grids) of every stripped item only for M-RoPE models (``strip_covered_mm_data(..., uses_mrope=...)``), and a
# rank computes whole-prompt positions from those grids only for M-RoPE models (``common.mrope``). Decided
# twice with different rules, a model where they disagreed would reach the ranks with stripped items that lack
# the grids their positions need. Both sides therefore call :func:`uses_mrope` on the same ``config.json``.
#
# Rule: M-RoPE when the model type (of the model or of its text part) is that of a family whose positions are M-RoPE
# (``common/families/``: ``Family.uses_mrope``), or when
# the rope parameters (``rope_parameters``, or the older ``rope_scaling``) of the model or of its ``text_config``
# carry ``mrope_section`` — also per layer type (transformers 5.x may nest rope parameters by layer type). The
# model-type arm matters: transformers 5.x's default ``Qwen2VLConfig`` carries no ``mrope_section`` at all (the
# model splits the rotary dimensions by its own default), while checkpoints on the Hub write one in
# ``rope_scaling``.


def _mrope_model_types() -> frozenset[str]:
    return frozenset(t for f in _families() if f.uses_mrope for t in (*f.model_types, *f.text_model_types))


def _has_mrope_section(rope: Any) -> bool:
    if not isinstance(rope, dict):
        return False
    if "mrope_section" in rope:
        return True
    return any(isinstance(v, dict) and "mrope_section" in v for v in rope.values())  # per-layer-type parameters


def uses_mrope(config: Any) -> bool:
    """True when the model's positions are M-RoPE (the rule in the comment above).

    ``config`` is a transformers config (the whole model's or its ``text_config``) or ``config.json`` as a dict.
    """
    mrope_types = _mrope_model_types()
    text_config = config_get(config, "text_config")
    for holder in (config, text_config):
        if config_get(holder, "model_type") in mrope_types:
            return True
        for name in ("rope_parameters", "rope_scaling"):
            if _has_mrope_section(config_get(holder, name)):
                return True
    return False
