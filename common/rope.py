"""Whether a model's positions are M-RoPE: the one rule the scheduler and the ranks share.

The answer decides two things that must agree across processes: the scheduler keeps the ``keep_on_cpu`` fields
(grids) of every stripped item only for M-RoPE models (``strip_covered_mm_data(..., uses_mrope=...)``), and a
rank computes whole-prompt positions from those grids only for M-RoPE models (``worker_svc.mrope``). Decided
twice with different rules, a model where they disagreed would reach the ranks with stripped items that lack
the grids their positions need. Both sides therefore call :func:`uses_mrope` on the same ``config.json``.

Rule: M-RoPE when the model type (of the model or of its text part) is that of a family whose positions are M-RoPE
(``common/families/``: ``Family.uses_mrope``), or when
the rope parameters (``rope_parameters``, or the older ``rope_scaling``) of the model or of its ``text_config``
carry ``mrope_section`` — also per layer type (transformers 5.x may nest rope parameters by layer type). The
model-type arm matters: transformers 5.x's default ``Qwen2VLConfig`` carries no ``mrope_section`` at all (the
model splits the rotary dimensions by its own default), while checkpoints on the Hub write one in
``rope_scaling``.
"""

from __future__ import annotations

from typing import Any

from common.families import all_families

# The model types (and their text parts' types) whose positions are M-RoPE.
MROPE_MODEL_TYPES = frozenset(
    t for f in all_families() if f.uses_mrope for t in (*f.model_types, *f.text_model_types)
)


def config_get(obj: Any, name: str) -> Any:
    """``obj.name`` for a transformers config, ``obj[name]`` for its ``config.json`` dict; None when absent."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(name)
    return getattr(obj, name, None)


def _has_mrope_section(rope: Any) -> bool:
    if not isinstance(rope, dict):
        return False
    if "mrope_section" in rope:
        return True
    return any(isinstance(v, dict) and "mrope_section" in v for v in rope.values())  # per-layer-type parameters


def uses_mrope(config: Any) -> bool:
    """True when the model's positions are M-RoPE (see the module docstring for the rule).

    ``config`` is a transformers config (the whole model's or its ``text_config``) or ``config.json`` as a dict.
    """
    text_config = config_get(config, "text_config")
    for holder in (config, text_config):
        if config_get(holder, "model_type") in MROPE_MODEL_TYPES:
            return True
        for name in ("rope_parameters", "rope_scaling"):
            if _has_mrope_section(config_get(holder, name)):
                return True
    return False
