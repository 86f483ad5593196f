"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer projector and a Llama (or other
1-D RoPE) decoder. The family without M-RoPE: nothing about an image is needed once its tokens are computed.

- Processor: the folder's ``LlavaProcessor`` itself (it has no video processor, so transformers builds it without
  torchvision) over the PIL ``CLIPImageProcessorPil``: resize the shortest edge, then a center crop to
  ``crop_size``. Every image therefore becomes the same ``pixel_values`` shape ``(1, 3, crop_h, crop_w)`` and the
  same number of placeholder tokens.
- Header rule: the processor's own count for an image size (``LlavaProcessor._get_num_multimodal_tokens``: patches
  of the crop, plus ``num_additional_image_tokens``, minus the CLS row the ``default`` feature strategy drops) —
  the same for every size. ``tests/scheduler/test_llava_frontend.py`` compares it with the processor's output.
- No grid field: the processor gives none, and positions need none. A prefix-covered item keeps no field at all
  (``strip_covered_mm_data(..., uses_mrope=False)`` sets its data to None): a rank receives only its identifier and
  placeholder range.
- Positions: 1-D, the token's index (what ``LlavaForConditionalGeneration`` computes from its cache position when
  it is given none); the rank gives them as ``(1, tokens)``.
- Encoder: ``model.model.get_image_features(pixel_values)`` with the config's own ``vision_feature_layer`` and
  ``vision_feature_select_strategy`` (their defaults come from the config, as in the model's forward); its
  ``pooler_output`` is one ``[tokens, hidden]`` tensor per image, the rows that replace the placeholder embeddings.
- Tensor parallel: the checkpoint's own plan (the Llama/Qwen2 text configs' ``base_model_tp_plan``: q/k/v and
  gate/up column-wise, o and down row-wise), prefixed by transformers with ``model.language_model.``.
"""

from __future__ import annotations

from common.families.base import Family, config_get


class LlavaFamily(Family):
    name = "llava"
    model_types = frozenset({"llava"})
    # Its text parts are generic decoders (llama, qwen2, ...) that other checkpoints use alone: no type here.
    text_model_types: frozenset[str] = frozenset()
    uses_mrope = False
    grid_field = None
    tool_format = None  # LLaVA checkpoints' templates take no tools

    def load_processor_class(self, config):
        from transformers import LlavaProcessor

        return LlavaProcessor

    def image_grid(self, image_processor, height: int, width: int):
        return None

    def image_tokens(self, processor, image_processor, height: int, width: int) -> int:
        if processor is None:
            raise ValueError("the LLaVA token count is the processor's (patch size, feature strategy): none given")
        data = processor._get_num_multimodal_tokens(image_sizes=[[height, width]])
        return int(data["num_image_tokens"][0])

    def grid_tokens(self, image_processor, grid) -> int:
        raise ValueError("a LLaVA image has no grid; its token count is image_tokens'")

    def grid_problem(self, config, grid, grid_name: str) -> str | None:
        return None  # no grid field: nothing to check

    def pixel_problem(self, config, pixels, grid, pixels_name: str, grid_name: str) -> str | None:
        vision = config_get(config, "vision_config")
        size = int(config_get(vision, "image_size") or 0)
        channels = int(config_get(vision, "num_channels") or 3)
        want = (1, channels, size, size)
        if pixels.dim() != 4 or not pixels.dtype.is_floating_point or tuple(pixels.shape) != want:
            return (
                f"{pixels_name} must be one float image of shape {want} (the vision tower's image_size {size}); "
                f"got {pixels.dtype}{tuple(pixels.shape)}"
            )
        return None

    def encode(self, model, pixels, grid, video: bool):
        import torch

        if video:
            raise ValueError("LLaVA serves images only")
        rows = model.model.get_image_features(pixels, return_dict=True).pooler_output
        return torch.cat(list(rows), dim=0) if isinstance(rows, tuple | list) else rows.reshape(-1, rows.shape[-1])


LLAVA = LlavaFamily()
FAMILIES = (LLAVA,)
