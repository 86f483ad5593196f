"""Qwen3-VL (dense): the Qwen2-VL family's processor, header rule and image positions, plus DeepStack and a
decoder tensor-parallel plan of its own.

- Processor: ``Qwen3VLProcessor`` without its video processor, over the PIL ``Qwen2VLImageProcessorPil``
  (patch 16, merge 2: a 32-pixel grid step); the header rule is the same ``smart_resize``.
- Positions: interleaved M-RoPE. The position ids are the Qwen2-VL family's for images (transformers 5.24's
  ``Qwen3VLModel.get_rope_index``: ``start + (t, h, w)`` over the merged grid, text resuming at ``start + max(h, w)``,
  checked by ``tests/worker/test_mrope.py``); the interleaving of the temporal/height/width frequencies
  (``mrope_interleaved``) happens inside the model's rotary embedding, from the same ids. A stripped item therefore
  keeps its ``keep_on_cpu`` grid. A video is one item whose placeholder range holds, per temporal patch, the
  processor's ``<t seconds>`` text, a vision start, the patch's placeholders and a vision end; ``is_embed`` marks
  the placeholders, and positions treat each temporal patch as its own ``(1, h, w)`` block with the text between
  (5.24's ``get_rope_index`` splits the video's grid the same way; ``common/mrope.py``).
- Encoder: ``get_image_features`` (``get_video_features`` for a video, the same tower) gives the merged rows (``pooler_output``) and one DeepStack row set per level of
  ``vision_config.deepstack_visual_indexes``. A row here is ``[merged | level 0 | level 1 | ...]``
  (``row_width = hidden * (1 + levels)``), so the encoder cache, the owner rank's broadcast over the group and the
  window slicing carry every level with the item, unchanged.
- Language model: the first ``hidden`` values of a row replace the placeholder embedding; level ``k`` is added to
  the hidden state after decoder layer ``k`` at the same tokens — the model's own ``visual_pos_masks`` and
  ``deepstack_visual_embeds`` arguments, given for the packed sequence.
- Tensor parallel: 5.24's ``Qwen3VLTextConfig.base_model_tp_plan`` shards only the embedding, so the plan here
  shards the decoder as Qwen2-VL's does (q/k/v and gate/up column-wise, o and down row-wise; ``q_norm``/``k_norm``
  are per head and need no split), keeping each rank's KV heads what ``common/model_checks.py`` expects.
"""

from __future__ import annotations

from typing import Any

from common.families.base import config_get
from common.families.qwen2_vl import Qwen2VLFamily

_DECODER = "model.language_model.layers.*."
TP_PLAN = {
    _DECODER + "self_attn.q_proj": "colwise",
    _DECODER + "self_attn.k_proj": "colwise",
    _DECODER + "self_attn.v_proj": "colwise",
    _DECODER + "self_attn.o_proj": "rowwise",
    _DECODER + "mlp.gate_proj": "colwise",
    _DECODER + "mlp.up_proj": "colwise",
    _DECODER + "mlp.down_proj": "rowwise",
}


def deepstack_levels(config: Any) -> int:
    return len(config_get(config_get(config, "vision_config"), "deepstack_visual_indexes") or ())


class Qwen3VLFamily(Qwen2VLFamily):
    name = "qwen3-vl"
    model_types = frozenset({"qwen3_vl"})
    text_model_types = frozenset({"qwen3_vl_text"})
    temporal_step_by_seconds = False

    def row_width(self, config, hidden: int) -> int:
        return hidden * (1 + deepstack_levels(config))

    def encode(self, model, pixels, grid, video: bool):
        import torch

        features = model.model.get_video_features if video else model.model.get_image_features
        out = features(pixels, grid, return_dict=True)
        merged = torch.cat(list(out.pooler_output), dim=0)
        levels = [torch.cat(list(level), dim=0) for level in out.deepstack_features]
        return torch.cat([merged, *levels], dim=1)

    def text_model_kwargs(self, hidden: int, length: int, indices, rows) -> dict[str, Any]:
        import torch

        levels = rows.shape[1] // hidden - 1
        if levels == 0:
            return {}
        mask = torch.zeros(1, length, dtype=torch.bool, device=indices.device)
        mask[0, indices] = True
        return {
            "visual_pos_masks": mask,  # (1, tokens): the tokens taking encoder rows, in sequence order
            "deepstack_visual_embeds": [rows[:, hidden * (k + 1) : hidden * (k + 2)] for k in range(levels)],
        }

    def tp_plan(self, model_config, tp: int) -> dict[str, str] | None:
        return dict(TP_PLAN)


QWEN3_VL = Qwen3VLFamily()
FAMILIES = (QWEN3_VL,)
