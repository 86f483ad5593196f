"""Qwen2-VL and Qwen2.5-VL: M-RoPE positions, one vision tower output row per merged patch, no extra decoder
inputs, the checkpoint's own tensor-parallel plan.

- Processor: the folder's ``Qwen2VLProcessor`` / ``Qwen2_5_VLProcessor`` without its video processor (transformers
  5.24 builds a torchvision one for every checkpoint of the family) and the PIL image processor.
- Header rule: ``smart_resize(h, w, patch * merge, min/max pixels)`` then one patch row per ``patch`` pixels.
- After a prefix hit a stripped item keeps its ``keep_on_cpu`` grids (``image_grid_thw``, ``video_grid_thw``,
  ``second_per_grid_ts``): the positions of every later token depend on them.
- Positions: ``common.mrope`` (transformers 5.x's ``get_rope_index``); Qwen2-VL steps video frames by 1,
  Qwen2.5-VL by ``tokens_per_second * second_per_grid_t``.
- Encoder: ``model.model.get_image_features`` / ``get_video_features``, whose ``pooler_output`` holds the merged rows;
  they replace the placeholder embeddings and nothing else.
"""

from __future__ import annotations

from typing import Any

from common.families.base import Family, config_get


class Qwen2VLFamily(Family):
    uses_mrope = True
    temporal_step_by_seconds = True  # Qwen2.5-VL; Qwen2-VL overrides

    def image_grid(self, image_processor, height: int, width: int):
        import torch
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        patch = int(image_processor.patch_size)
        size = image_processor.size
        h, w = smart_resize(
            height,
            width,
            patch * int(image_processor.merge_size),
            min_pixels=size["shortest_edge"],
            max_pixels=size["longest_edge"],
        )
        return torch.tensor([[1, h // patch, w // patch]], dtype=torch.int64)

    def rope_kwargs(self, config) -> dict[str, Any]:
        vision = config_get(config, "vision_config")
        merge = config_get(vision, "spatial_merge_size") or config_get(config, "spatial_merge_size") or 2
        tokens_per_second = config_get(vision, "tokens_per_second") if self.temporal_step_by_seconds else None
        return {"spatial_merge_size": int(merge), "tokens_per_second": tokens_per_second}

    def encode(self, model, pixels, grid, video: bool):
        import torch

        inner = model.model
        features = inner.get_video_features if video else inner.get_image_features
        rows = features(pixels, grid, return_dict=True).pooler_output
        return torch.cat(list(rows), dim=0) if isinstance(rows, tuple | list) else rows


class _Qwen2(Qwen2VLFamily):
    name = "qwen2-vl"
    model_types = frozenset({"qwen2_vl"})
    text_model_types = frozenset({"qwen2_vl_text"})
    temporal_step_by_seconds = False  # Qwen2-VL ignores second_per_grid_ts: video frames step by 1


class _Qwen25(Qwen2VLFamily):
    name = "qwen2.5-vl"
    model_types = frozenset({"qwen2_5_vl"})
    text_model_types = frozenset({"qwen2_5_vl_text"})


QWEN2_VL = _Qwen2()
QWEN2_5_VL = _Qwen25()
FAMILIES = (QWEN2_VL, QWEN2_5_VL)
