"""The recipe of the tiny model (common/tiny_model.py) as data: its variants and widths, the special tokens, the chat
template, the image and video processor settings, the decoder and vision tower configurations per variant and the
real and head-64 widths. The builders read these tables; nothing here builds anything."""

from __future__ import annotations

VARIANTS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava")
WIDTHS = ("tiny", "real", "head64")
DEFAULT_KV_HEADS = 4
KV_HEAD_CHOICES = (1, 2, 4, 8)  # divisors of the 8 query heads

# Written last by a build; its presence means the folder is complete. It records what was built.
MARKER_FILE = "mmcast_tiny_model.json"

VOCAB_SIZE = 1024
# Qwen2-VL's added tokens, in the order (and so with the relative ids) of the real tokenizer; they take the top
# of the vocabulary, the trained BPE tokens the ids below.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
FIRST_SPECIAL_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)
SPECIAL_TOKEN_IDS = {token: FIRST_SPECIAL_ID + i for i, token in enumerate(SPECIAL_TOKENS)}

# Qwen2's pre-tokenizer split (the regex of transformers' Qwen2Tokenizer); with the same normaliser, byte-level
# step and decoder, the saved tokenizer.json and the class that reloads it agree.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# The Qwen2-VL chat format: `<|im_start|>{role}\n{content}<|im_end|>\n` per turn, a default system turn when the
# conversation has none, each image as `<|vision_start|><|image_pad|><|vision_end|>` (the processor expands the pad
# into one token per merged patch), each video likewise with `<|video_pad|>`.
CHAT_TEMPLATE = (
    # No whitespace control: transformers renders with trim_blocks, so no newline may directly follow a `%}`.
    # The Qwen-VL layout, with the tools section, tool calls and tool responses of the family's tool-calling
    # checkpoints (Hermes style: <tools>, <tool_call>, <tool_response>); a conversation without tools renders as the
    # Qwen2-VL checkpoints' template does.
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% macro render_content(content) %}"
    "{% if content is string %}"
    "{{ content }}"
    "{% elif content %}"
    "{% for part in content %}"
    "{% if part['type'] == 'image' or 'image' in part or 'image_url' in part %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in part %}"
    "{{ part['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% endif %}"
    "{% endmacro %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ render_content(messages[0]['content']) }}"
    "{% else %}You are a helpful assistant.{% endif %}{{ '\\n' }}"
    "\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}"
    "</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' and not tools %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% if message['role'] == 'system' and tools %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}{{ '\\n' }}"
    "<tool_response>\n{{ render_content(message['content']) }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant"
    "{% if message['content'] %}{{ '\\n' }}{{ render_content(message['content']) }}{% endif %}"
    "{% for tool_call in message['tool_calls'] %}"
    "{% if tool_call['function'] is defined %}{% set tool_call = tool_call['function'] %}{% endif %}{{ '\\n' }}"
    '<tool_call>\n{"name": "{{ tool_call[\'name\'] }}", "arguments": '
    "{{ tool_call['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ render_content(message['content']) }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-VL-2B-Instruct's preprocessor_config.json.
IMAGE_PROCESSOR_SETTINGS = {
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 16384,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}

# Shared by both variants. Widths: head_dim = 128 / 8 = 16; mrope_section sums to head_dim / 2 (temporal, height,
# width rotary pairs). max_position_embeddings covers the ~32k-token benchmark prompts with room to spare.
TEXT_CONFIG = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
    "use_sliding_window": False,
    "max_window_layers": 2,
    # 5x transformers' default: logits spread enough that greedy tokens vary and swapping one image moves the
    # last token's log-probabilities by ~1 (at 0.02: ~0.1, and greedy decoding repeats one token).
    "initializer_range": 0.1,
    "bos_token_id": SPECIAL_TOKEN_IDS["<|endoftext|>"],
    "eos_token_id": SPECIAL_TOKEN_IDS["<|im_end|>"],
    "pad_token_id": SPECIAL_TOKEN_IDS["<|endoftext|>"],
}

# Qwen3-VL-2B-Instruct's preprocessor_config.json, but with Qwen2-VL's minimum pixels (module docstring).
QWEN3_IMAGE_PROCESSOR_SETTINGS = {
    **IMAGE_PROCESSOR_SETTINGS,
    "patch_size": 16,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}

# video_preprocessor_config.json (transformers' video processor of the family: Qwen2VLVideoProcessor for Qwen2-VL
# and Qwen2.5-VL, Qwen3VLVideoProcessor for Qwen3-VL), written as JSON so no torchvision is needed to build it.
# The real checkpoints' sampling (2 frames a second, do_sample_frames) and normalisation (the image processor's), but
# size bounds for small test clips: the real minimum (128 merged patches a frame) would upscale a 160x120 clip to
# 100k pixels. Qwen2-VL's bounds are per frame: at least 56x56, at most 64 tokens (28*28*64 pixels); Qwen3-VL's
# bound the whole sampled video (frames x height x width, its smart_resize): at least 64x64, at most 64 tokens a
# frame over 8 frames. cap_pixels_per_frame is pinned False (transformers warns when it is unset and plans to make
# True the default), so token counts do not change with the transformers version.
VIDEO_PROCESSOR_SETTINGS = {
    "qwen2_vl": {
        "video_processor_type": "Qwen2VLVideoProcessor",
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 64},
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": IMAGE_PROCESSOR_SETTINGS["image_mean"],
        "image_std": IMAGE_PROCESSOR_SETTINGS["image_std"],
    },
    "qwen3_vl": {
        "video_processor_type": "Qwen3VLVideoProcessor",
        "size": {"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 64 * 8},
        "patch_size": 16,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": QWEN3_IMAGE_PROCESSOR_SETTINGS["image_mean"],
        "image_std": QWEN3_IMAGE_PROCESSOR_SETTINGS["image_std"],
    },
}
VIDEO_COMMON = {
    "do_resize": True,
    "resample": 3,  # BICUBIC
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
    "do_sample_frames": True,
    "fps": 2.0,
    "min_frames": 4,
    "max_frames": 64,
    "cap_pixels_per_frame": False,
}


VISION_CONFIGS = {
    # Output width (`hidden_size` here) is the text model's hidden size.
    "qwen2_vl": {
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": 128,
        "mlp_ratio": 2,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "initializer_range": 0.02,
    },
    # Here `hidden_size` is the tower's own width and `out_hidden_size` the text model's. A 56-pixel window is
    # 2x2 merged patches, so even the small test images span several windows; block 0 attends within windows,
    # block 1 over the whole image (fullatt_block_indexes).
    "qwen2_5_vl": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 128,
        "num_heads": 4,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [1],
        "tokens_per_second": 2,
        "initializer_range": 0.02,
    },
    # `out_hidden_size` is the text model's width; 64 learned position embeddings (an 8x8 grid, interpolated to
    # each image's); both blocks feed a DeepStack merger.
    "qwen3_vl": {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": 128,
        "num_heads": 4,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [0, 1],
        "initializer_range": 0.02,
    },
}

# Qwen3-VL's text part: head_dim explicit, interleaved M-RoPE, no sliding-window settings.
QWEN3_TEXT = {
    "head_dim": 16,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [2, 3, 3],
        "mrope_interleaved": True,
    },
}


# width="real": Qwen2-VL-2B-Instruct's config.json widths, with 2 decoder layers and 2 vision blocks (of 28 and 32).
REAL_WIDTH = {
    "text": {
        "vocab_size": 151936,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "max_window_layers": 2,
        "initializer_range": 0.02,
        # head_dim 128: Qwen2-VL-2B's temporal/height/width rotary pairs
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    },
    "vision": {"depth": 2, "embed_dim": 1280, "hidden_size": 1536, "mlp_ratio": 4, "num_heads": 16},
    "tie_word_embeddings": True,
}


# width="real" for Qwen3-VL: Qwen3-VL-2B-Instruct's config.json widths, with 2 decoder layers and 2 vision blocks (of
# 28 and 24), both feeding DeepStack (the checkpoint's 3 levels come from blocks 5, 11 and 17).
QWEN3_REAL_WIDTH = {
    "text": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "initializer_range": 0.02,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    },
    "vision": {
        "depth": 2,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "out_hidden_size": 2048,
        "num_position_embeddings": 2304,
    },
    "tie_word_embeddings": True,
}


# width="head64": the tiny recipe with head_dim 64 everywhere (vLLM's CPU attention has no kernel for 16). Query,
# KV and vision heads divide by 2 (TP 1 and 2 shard it; at TP 4 each KV head is held by two ranks, the vision heads
# split one each).
HEAD64_WIDTH = {
    "text": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        # head_dim 64: Qwen2-VL-2B's 1:1.5:1.5 split of the rotary pairs, halved
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
    },
    "vision": {"embed_dim": 256, "hidden_size": 256, "num_heads": 4},
    "tie_word_embeddings": False,
}
