"""What a checkpoint's ``config.json`` allows, checked before any weight is loaded: one rule for ``serve-local``,
the scheduler and every rank.

- The model type is one mmcast serves (``SUPPORTED_MODEL_TYPES``: those of the families in ``common/families/``,
  each of which says how its positions, vision tower and processor are served) and the checkpoint has a vision tower (``vision_config``).
- A tensor-parallel size ``tp`` shards the decoder when its attention heads divide by ``tp``, its KV heads divide
  by ``tp`` or ``tp`` divides by its KV heads, and its MLP width (``intermediate_size``) divides by ``tp``.
  With more ranks than KV heads, each KV head is replicated on ``tp / kv_heads`` consecutive ranks, which are
  exactly the ranks holding the query heads that read it (rank ``r`` holds query heads ``[r * H / tp, (r + 1) *
  H / tp)`` and KV head ``r // (tp / kv_heads)``), as vLLM does; ``worker_svc/kv_replication.py`` loads it so.

The rule reads plain ``config.json`` (a dict; no transformers import, so the CLI checks in milliseconds) and also
accepts a transformers config object. The text fields come from ``text_config`` when present, else from the top
level (the layout of the Qwen2-VL checkpoints on the Hub). A violation raises ``ModelConfigError`` whose message is
one line naming the flag as the user gave it and, for the TP size, the valid values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from common.families import config_get, supported_model_types

SUPPORTED_MODEL_TYPES = supported_model_types()


class ModelConfigError(ValueError):
    """The checkpoint cannot be served as configured; the message is one line a user can act on."""


def read_config(model_dir: str | os.PathLike, flag: str = "--model") -> dict:
    """``config.json`` of ``model_dir`` as a dict; ``ModelConfigError`` naming ``flag`` when absent or invalid."""
    path = os.path.join(os.fspath(model_dir), "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        raise ModelConfigError(f"{flag} {model_dir}: not a model folder (no config.json)") from None
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"{flag} {model_dir}: cannot read config.json: {exc}") from None
    if not isinstance(config, dict):
        raise ModelConfigError(f"{flag} {model_dir}: config.json does not hold a JSON object")
    return config


@dataclasses.dataclass(frozen=True)
class DecoderShape:
    """The decoder widths that tensor parallelism splits."""

    heads: int  # attention (query) heads
    kv_heads: int  # key/value heads (== heads without grouped-query attention)
    intermediate: int | None  # MLP width; None when the config does not say

    @classmethod
    def from_config(cls, config: Any) -> DecoderShape:
        text = config_get(config, "text_config")
        holder = text if text is not None else config
        heads = config_get(holder, "num_attention_heads")
        if not isinstance(heads, int) or heads < 1:
            raise ModelConfigError(f"config.json gives no valid num_attention_heads (got {heads!r})")
        kv_heads = config_get(holder, "num_key_value_heads")
        kv_heads = heads if kv_heads is None else kv_heads  # transformers' reading: no grouping
        if not isinstance(kv_heads, int) or not 1 <= kv_heads <= heads or heads % kv_heads:
            raise ModelConfigError(
                f"config.json: num_key_value_heads={kv_heads!r} must divide num_attention_heads={heads}"
            )
        intermediate = config_get(holder, "intermediate_size")
        return cls(heads, kv_heads, intermediate if isinstance(intermediate, int) else None)

    def tp_problem(self, tp: int) -> str | None:
        """Why ``tp`` ranks cannot shard this decoder, or None when they can."""
        if tp < 1:
            return "the tensor-parallel size must be at least 1"
        if self.heads % tp:
            return f"its {self.heads} attention heads do not divide into {tp} equal parts"
        if self.kv_heads % tp and tp % self.kv_heads:
            return (
                f"its {self.kv_heads} KV heads neither divide into {tp} equal parts nor replicate evenly "
                f"over {tp} ranks"
            )
        if self.intermediate is not None and self.intermediate % tp:
            return f"its MLP width (intermediate_size={self.intermediate}) does not divide into {tp} equal parts"
        return None

    def valid_tp_sizes(self) -> list[int]:
        """Every TP size that shards this decoder (at most one query head per rank, so none above ``heads``)."""
        return [tp for tp in range(1, self.heads + 1) if self.tp_problem(tp) is None]

    def kv_heads_local(self, tp: int) -> int:
        """KV heads one rank holds: ``kv_heads / tp``, or 1 (replicated) when ``tp`` exceeds ``kv_heads``."""
        return max(1, self.kv_heads // tp)

    def kv_replicas(self, tp: int) -> int:
        """How many ranks hold each KV head: 1 unless ``tp`` exceeds ``kv_heads``."""
        return max(1, tp // self.kv_heads)

    def kv_heads_of_rank(self, tp: int, rank: int) -> range:
        """The KV heads rank ``rank`` of ``tp`` holds (global indices)."""
        local = self.kv_heads_local(tp)
        first = (rank // self.kv_replicas(tp)) * local
        return range(first, first + local)


def check_serveable(config: Any, flag: str = "--model", model_dir: str | os.PathLike | None = None) -> None:
    """Model type supported and a vision tower present; ``ModelConfigError`` naming ``flag`` otherwise."""
    where = f"{flag} {model_dir}" if model_dir is not None else flag
    model_type = config_get(config, "model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"{where}: model type {model_type!r} is not supported; mmcast serves {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if not config_get(config, "vision_config"):
        raise ModelConfigError(f"{where}: config.json has no vision_config (a {model_type} checkpoint has one)")


def check_tp(config: Any, tp: int, flag: str, given: str | None = None, values: str | None = None) -> DecoderShape:
    """The decoder shape when ``tp`` ranks shard it, else ``ModelConfigError``.

    ``flag`` names the setting (``--tp``, ``--world-size``). The scheduler, whose TP size is the number of
    ``--workers`` addresses, says how the user gave it (``given``, default ``"{flag} {tp}"``) and what the valid
    values are (``values``, default ``"{flag} values"``).
    """
    shape = DecoderShape.from_config(config)
    problem = shape.tp_problem(tp)
    if problem is not None:
        valid = ", ".join(str(t) for t in shape.valid_tp_sizes())
        raise ModelConfigError(
            f"{given or f'{flag} {tp}'}: this checkpoint cannot be split over {tp} tensor-parallel ranks: {problem}; "
            f"valid {values or f'{flag} values'} for this checkpoint: {valid}"
        )
    return shape


def check_checkpoint(
    model_dir: str | os.PathLike, tp: int, flag: str, given: str | None = None, values: str | None = None
) -> DecoderShape:
    """Every check of this module on ``model_dir``'s ``config.json``, for ``tp`` ranks; returns the decoder shape."""
    config = read_config(model_dir)
    check_serveable(config, model_dir=model_dir)
    return check_tp(config, tp, flag, given, values)
