"""KV-head replication: tensor parallelism over more ranks than the model has KV heads.

transformers' tensor-parallel plan shards ``k_proj``/``v_proj`` column-wise like ``q_proj``, which needs the KV
heads to divide by the TP size. When the TP size is a multiple of the KV heads instead (Qwen2-VL-2B: 2 KV heads,
``--tp 4``), each rank needs whole KV heads: the one its query heads read (``common/model_checks.py``: rank ``r``
holds KV head ``r // (tp / kv_heads)``), replicated on the ``tp / kv_heads`` ranks that share it, as vLLM does.

Done with the library's own model classes and loader: the TP plan marks ``k_proj``/``v_proj`` ``"replicate"``
(every rank loads them whole; they are small: ``2 * kv_heads * head_dim`` rows), then ``keep_rank_kv_heads`` cuts
each rank's copy down to its KV head rows and sets the attention module's query-heads-per-KV-head
(``num_key_value_groups``) to what the rank holds. q/o projections and the MLP stay sharded by the plan. The
rank's KV pool then holds ``kv_heads_local = 1`` head per layer.
"""

from __future__ import annotations

import torch

from common.model_checks import DecoderShape

_KV_PROJECTIONS = ("k_proj", "v_proj")


def tp_plan_override(model_config, tp: int, base_plan: dict[str, str] | None = None) -> dict[str, str] | None:
    """The ``DistributedConfig(tp_plan=...)`` override that replicates ``k_proj``/``v_proj`` when ``tp`` exceeds
    the KV heads, else None (the plan unchanged). ``base_plan``: the family's plan, when it replaces the model's.

    The plan's keys are the model's module paths (``model.language_model.layers.*.self_attn.k_proj``), read from
    a skeleton of the model built on the meta device (no memory, no weights).
    """
    if DecoderShape.from_config(model_config).kv_replicas(tp) == 1:
        return None
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        skeleton = AutoModelForImageTextToText.from_config(model_config)
    plan = base_plan if base_plan is not None else skeleton.tp_plan
    override = {key: "replicate" for key in plan if key.rsplit(".", 1)[-1] in _KV_PROJECTIONS}
    if base_plan is not None:
        override = {**base_plan, **override}
    if not override:
        raise ValueError(f"{type(skeleton).__name__}'s tensor-parallel plan names no k_proj/v_proj to replicate")
    return override


def _attention_modules(model) -> list[torch.nn.Module]:
    return [
        m for m in model.modules() if all(isinstance(getattr(m, p, None), torch.nn.Linear) for p in _KV_PROJECTIONS)
    ]


def keep_rank_kv_heads(model, shape: DecoderShape, tp: int, rank: int) -> int:
    """Cuts every replicated ``k_proj``/``v_proj`` of the decoder to the KV heads of ``rank``; returns the number
    of attention modules changed. Run after ``from_pretrained`` with ``tp_plan_override``.

    The vision tower's attention (a fused ``qkv``) is not touched: it is replicated whole on every rank.
    """
    heads = shape.kv_heads_of_rank(tp, rank)
    queries_local = shape.heads // tp
    changed = 0
    for attention in _attention_modules(model):
        for name in _KV_PROJECTIONS:
            proj: torch.nn.Linear = getattr(attention, name)
            if proj.out_features % shape.kv_heads:
                raise ValueError(f"{name} has {proj.out_features} outputs, not a multiple of {shape.kv_heads} KV heads")
            head_dim = proj.out_features // shape.kv_heads
            rows = slice(heads.start * head_dim, heads.stop * head_dim)
            # clone(): the rank keeps its heads' rows only, not a view pinning the whole replicated weight
            proj.weight = torch.nn.Parameter(proj.weight.detach()[rows].clone(), requires_grad=False)
            if proj.bias is not None:
                proj.bias = torch.nn.Parameter(proj.bias.detach()[rows].clone(), requires_grad=False)
            proj.out_features = len(heads) * head_dim
        # The attention functions repeat each KV head for this many query heads (sdpa/eager read the module's value).
        attention.num_key_value_groups = queries_local // len(heads)
        changed += 1
    return changed
