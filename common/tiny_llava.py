"""The tiny LLaVA of ``common/tiny_model.py`` (``variant="llava"``): llava-1.5's architecture, narrow.

``LlavaForConditionalGeneration`` as llava-hf/llava-1.5-7b-hf builds it — a CLIP vision tower (CLS token, features
of the second-to-last layer, ``vision_feature_select_strategy="default"`` dropping the CLS row), a two-layer GELU
projector, a Llama decoder with 1-D RoPE — at the tiny model's widths: decoder hidden 128, 2 layers, 8 query / 4 KV
heads of width 16 (so TP 1, 2 and 4 shard it), the shared 1024-token vocabulary; a CLIP tower of width 32, 2
layers, 4 heads, patch 14 on a 42x42 image. The processor is llava-1.5's (``LlavaProcessor`` over the CLIP image
processor: resize the shortest edge to 42, center crop 42x42, CLIP's mean and std), so every image is 3x3 patches
= 9 placeholder tokens. The tokenizer and chat template are the tiny Qwen2-VL ones (``<|image_pad|>`` is the image
token), so the tests' prompts have the same layout in every family.

Saved as a Hub LLaVA checkpoint is: ``config.json`` (``model_type`` ``llava``), the weights, and the processor's own
``save_pretrained`` (``processor_config.json`` with the patch size and feature strategy the token count needs,
beside ``preprocessor_config.json``, the tokenizer files and ``chat_template.jinja``).
"""

from __future__ import annotations

CROP = 42  # pixels: the CLIP image size (llava-1.5: 336)
PATCH = 14
IMAGE_TOKENS = (CROP // PATCH) ** 2  # the CLS row is dropped by the "default" feature strategy

# CLIP's preprocessing constants (llava-1.5's preprocessor_config.json), at the tiny crop.
IMAGE_PROCESSOR_SETTINGS = {
    "size": {"shortest_edge": CROP},
    "crop_size": {"height": CROP, "width": CROP},
    "do_center_crop": True,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

VISION_CONFIG = {
    "model_type": "clip_vision_model",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "image_size": CROP,
    "patch_size": PATCH,
    "projection_dim": 32,
    "initializer_range": 0.02,
}


def build_config(text: dict, token_ids: dict, kv_heads: int):
    """The LLaVA config over the tiny decoder settings ``text`` (``tiny_recipe.TEXT_CONFIG``), a Llama decoder with
    ``kv_heads`` KV heads and plain (1-D) RoPE."""
    from transformers import LlavaConfig

    llama = {k: v for k, v in text.items() if k not in ("use_sliding_window", "max_window_layers", "rope_parameters")}
    llama.update(
        model_type="llama",
        head_dim=16,
        num_key_value_heads=kv_heads,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    return LlavaConfig(
        vision_config=dict(VISION_CONFIG),
        text_config=llama,
        image_token_index=token_ids["image_token_id"],
        image_seq_length=IMAGE_TOKENS,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
        dtype="float32",
    )


def build_processor(tokenizer, chat_template: str):
    """llava-1.5's processor at the tiny crop: CLIP's PIL image processor, the CLS row counted and dropped."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    return LlavaProcessor(
        image_processor=CLIPImageProcessorPil(**IMAGE_PROCESSOR_SETTINGS),
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS row
        chat_template=chat_template,
        image_token="<|image_pad|>",
    )
