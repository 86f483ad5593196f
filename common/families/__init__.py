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

Every family module of this package defines a ``Family`` subclass (``common/families/base.py``) and lists its
instances in its ``FAMILIES``, which the registry here gathers.
Importing this package imports no torch or transformers: ``common/model_checks.py`` reads ``config.json`` with it
in milliseconds.
"""

from __future__ import annotations

from typing import Any

from common.families import llava, qwen2_vl, qwen3_vl
from common.families.base import Family, config_get

__all__ = ["Family", "config_get", "family_for_type", "family_of", "supported_model_types", "uses_mrope"]


# Every family mmcast serves, in the order of the README's table.
FAMILIES: tuple[Family, ...] = (*qwen2_vl.FAMILIES, *qwen3_vl.FAMILIES, *llava.FAMILIES)


def supported_model_types() -> tuple[str, ...]:
    return tuple(t for f in FAMILIES for t in sorted(f.model_types))


def family_for_type(model_type: str | None) -> Family | None:
    """The family whose checkpoints (or text parts) have ``model_type``; None when mmcast serves none."""
    for family in FAMILIES:
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
    return frozenset(t for f in FAMILIES if f.uses_mrope for t in (*f.model_types, *f.text_model_types))


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
