"""The embedded default model of mmcast: a tiny, randomly initialised Qwen2-VL (or Qwen2.5-VL, or Qwen3-VL).

`build_tiny_model` writes a complete Hugging Face model folder — `config.json`, `model.safetensors` (float32),
`generation_config.json`, a byte-level BPE tokenizer trained here on `common/data/tiny_corpus.txt`, the Qwen2-VL
chat template, the Qwen2-VL image processor with the real Qwen2-VL-2B-Instruct preprocessing settings and the
family's video processor settings (``video_preprocessor_config.json``, ``VIDEO_PROCESSOR_SETTINGS``). The
architecture is the real one, only narrow (hidden 128, 2 decoder layers, 8 query / 4 KV heads of width 16, a 2-block
vision tower, a 1024-token vocabulary with the Qwen2-VL special tokens at its top), so the folder is ~2.5 MB and
runs on a CPU in milliseconds. Nothing is downloaded.

``variant="qwen3_vl"`` is the same recipe on Qwen3-VL's architecture (``common/families/qwen3_vl.py``): interleaved
M-RoPE (``mrope_interleaved``), per-head q/k norms, a vision tower of patch 16 with learned position embeddings and
two DeepStack mergers (``deepstack_visual_indexes`` [0, 1]: features of both vision blocks are added after decoder
layers 0 and 1), and Qwen3-VL's image preprocessing (patch 16, mean/std 0.5) except its minimum of 256x256 pixels,
lowered to Qwen2-VL's 56x56 so the tests' small images stay a few tokens (a 112x84 image is 12 tokens in every
variant). Its chat template is the Qwen2-VL one above.

``variant="llava"`` is llava-1.5's architecture without M-RoPE (``common/tiny_llava.py``): a CLIP tower, a projector
and a Llama decoder of the same widths, every image 9 tokens.

Everything downstream loads it as it would load a local Qwen2-VL-2B-Instruct checkpoint, with no
`trust_remote_code`: `AutoModelForImageTextToText.from_pretrained(path)` for the model and
`common.processor.load_processor(path)` for the processor — `AutoProcessor.from_pretrained(path)` where torchvision is
installed, and the same processor without video support where it is not (transformers 5.24's `AutoProcessor` insists
on a torchvision video processor for every Qwen2-VL checkpoint). A real checkpoint folder replaces this one without
code changes. Head counts, KV head counts and widths divide by 4, so tensor parallel sizes 1, 2 and 4 all shard it.
``kv_heads=2`` builds the same model with 2 KV heads (the grouping of Qwen2-VL-2B): at TP 4 each KV head is then held
by two ranks.

``width="real"`` builds the same recipe at Qwen2-VL-2B's published widths (``REAL_WIDTH``: hidden 1536, 12 query /
2 KV heads, intermediate 8960, vocabulary 151936 with tied embeddings, a vision tower of width 1280 with 16 heads)
but only 2 decoder layers and 2 vision blocks, randomly initialised (~1.6 GB in float32). Memory measurements use it:
a rank's activations, KV pool and caches have their real sizes there (``benchmarks/rank/rank_memory.py``). Its tokenizer
is the tiny one (1024 tokens at the bottom of the large vocabulary, as Qwen2-VL-2B's 151657 tokens are of 151936).
For Qwen3-VL, ``width="real"`` takes Qwen3-VL-2B's widths (``QWEN3_REAL_WIDTH``: hidden 2048, 16 query / 8 KV
heads of width 128, intermediate 6144, a vision tower of width 1024 whose 2 blocks both feed DeepStack).

``width="head64"`` is the tiny model with heads of width 64 in the decoder and the vision tower (``HEAD64_WIDTH``:
hidden 256, 4 query / 2 KV heads, a vision tower of width 256 with 4 heads), still 2 layers, 2 vision blocks and the
1024-token vocabulary (~17 MB). It exists for the side-by-side benchmark with vLLM (``benchmarks/peer/compare.py``): vLLM's
CPU attention serves only head sizes from 32 up (32, 64, 80, 96, ...), not the tiny model's 16.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

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
_FIRST_SPECIAL_ID = VOCAB_SIZE - len(SPECIAL_TOKENS)
SPECIAL_TOKEN_IDS = {token: _FIRST_SPECIAL_ID + i for i, token in enumerate(SPECIAL_TOKENS)}

# Qwen2's pre-tokenizer split (the regex of transformers' Qwen2Tokenizer); with the same normaliser, byte-level
# step and decoder, the saved tokenizer.json and the class that reloads it agree.
_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

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
_TEXT_CONFIG = {
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
_VIDEO_COMMON = {
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


def video_processor_settings(variant: str) -> dict | None:
    """The ``video_preprocessor_config.json`` of `variant` as a dict; None for a variant without video (LLaVA)."""
    _check_variant(variant)
    if variant == "llava":
        return None
    own = VIDEO_PROCESSOR_SETTINGS["qwen3_vl" if variant == "qwen3_vl" else "qwen2_vl"]
    return {**_VIDEO_COMMON, **own, "processor_class": _processor_class(variant).__name__}


_VISION_CONFIGS = {
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
_QWEN3_TEXT = {
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


def _check_variant(variant: str, width: str = "tiny") -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not a tiny model variant; choose one of {VARIANTS}")
    if width not in WIDTHS:
        raise ValueError(f"width={width!r} is not a tiny model width; choose one of {WIDTHS}")
    if width == "head64" and variant != "qwen2_vl":
        raise ValueError(f"width={width!r} is built for Qwen2-VL only; variant={variant!r} must be 'qwen2_vl'")
    if width == "real" and variant == "qwen2_5_vl":
        raise ValueError(f"width={width!r} is built for Qwen2-VL and Qwen3-VL; variant={variant!r} is neither")


def corpus_path() -> pathlib.Path:
    """The shipped English text the tokenizer is trained on."""
    return pathlib.Path(__file__).with_name("data") / "tiny_corpus.txt"


def build_tokenizer():
    """Trains the byte-level BPE on the shipped corpus and wraps it as the tokenizer class Qwen2-VL uses."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    bpe = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_FIRST_SPECIAL_ID,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train([str(corpus_path())], trainer)
    if bpe.get_vocab_size() != _FIRST_SPECIAL_ID:
        # A shorter corpus would shift every special id; the config below hard-codes them.
        raise RuntimeError(
            f"{corpus_path()} trains only {bpe.get_vocab_size()} BPE tokens, {_FIRST_SPECIAL_ID} are needed; "
            "add text to the corpus"
        )
    bpe.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = Qwen2Tokenizer(
        tokenizer_object=bpe,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=None,
        model_max_length=_TEXT_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    tokenizer.chat_template = CHAT_TEMPLATE
    got = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    if got != SPECIAL_TOKEN_IDS or len(tokenizer) != VOCAB_SIZE:
        raise RuntimeError(f"special token ids {got} (vocab {len(tokenizer)}) differ from {SPECIAL_TOKEN_IDS}")
    return tokenizer


def _check_kv_heads(kv_heads: int) -> None:
    if kv_heads not in KV_HEAD_CHOICES:
        raise ValueError(f"kv_heads={kv_heads} must be one of {KV_HEAD_CHOICES} (it groups the 8 query heads)")


def build_config(variant: str = "qwen2_vl", *, kv_heads: int = DEFAULT_KV_HEADS, width: str = "tiny"):
    """The model config of `variant` with `kv_heads` KV heads, with the special token ids of `build_tokenizer`.

    ``width="real"``: Qwen2-VL-2B's widths and KV heads (``REAL_WIDTH``; for Qwen3-VL, Qwen3-VL-2B's:
    ``QWEN3_REAL_WIDTH``); ``width="head64"``: ``HEAD64_WIDTH``; for
    both, `kv_heads` is not used."""
    _check_variant(variant, width)
    _check_kv_heads(kv_heads)
    token_ids = {
        "image_token_id": SPECIAL_TOKEN_IDS["<|image_pad|>"],
        "video_token_id": SPECIAL_TOKEN_IDS["<|video_pad|>"],
        "vision_start_token_id": SPECIAL_TOKEN_IDS["<|vision_start|>"],
        "vision_end_token_id": SPECIAL_TOKEN_IDS["<|vision_end|>"],
    }
    if variant == "llava":
        from common import tiny_llava

        return tiny_llava.build_config(_TEXT_CONFIG, token_ids, kv_heads)
    if variant == "qwen2_vl":
        from transformers import Qwen2VLConfig as config_class
    elif variant == "qwen3_vl":
        from transformers import Qwen3VLConfig as config_class
    else:
        from transformers import Qwen2_5_VLConfig as config_class
    if width != "tiny":
        widths = HEAD64_WIDTH if width == "head64" else QWEN3_REAL_WIDTH if variant == "qwen3_vl" else REAL_WIDTH
        text = {**_TEXT_CONFIG, **widths["text"]}
        if variant == "qwen3_vl":
            text = {k: v for k, v in text.items() if k not in ("use_sliding_window", "max_window_layers")}
        return config_class(
            text_config=text,
            vision_config={**_VISION_CONFIGS[variant], **widths["vision"]},
            tie_word_embeddings=widths["tie_word_embeddings"],
            dtype="float32",
            **token_ids,
        )
    text = {**_TEXT_CONFIG, "num_key_value_heads": kv_heads}
    if variant == "qwen3_vl":
        text = {k: v for k, v in text.items() if k not in ("use_sliding_window", "max_window_layers")}
        text.update(_QWEN3_TEXT)
    return config_class(
        text_config=text,
        vision_config=dict(_VISION_CONFIGS[variant]),
        tie_word_embeddings=False,
        dtype="float32",
        **token_ids,
    )


def _processor_class(variant: str):
    if variant == "llava":
        from transformers import LlavaProcessor

        return LlavaProcessor
    if variant == "qwen2_vl":
        from transformers import Qwen2VLProcessor

        return Qwen2VLProcessor
    if variant == "qwen3_vl":
        from transformers import Qwen3VLProcessor

        return Qwen3VLProcessor
    from transformers import Qwen2_5_VLProcessor

    return Qwen2_5_VLProcessor


def build_processor(variant: str = "qwen2_vl", tokenizer=None):
    """The processor of `variant` (image-only): PIL image processor, tokenizer, chat template."""
    _check_variant(variant)
    from transformers import Qwen2VLImageProcessorPil

    from common.families.base import image_only

    tokenizer = build_tokenizer() if tokenizer is None else tokenizer
    if variant == "llava":
        from common import tiny_llava

        return tiny_llava.build_processor(tokenizer, CHAT_TEMPLATE)
    settings = QWEN3_IMAGE_PROCESSOR_SETTINGS if variant == "qwen3_vl" else IMAGE_PROCESSOR_SETTINGS
    image_processor = Qwen2VLImageProcessorPil(**settings)
    return image_only(_processor_class(variant))(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )


def build_model(variant: str = "qwen2_vl", *, seed: int = 0, kv_heads: int = DEFAULT_KV_HEADS, width: str = "tiny"):
    """The randomly initialised model of `variant`, in memory; the same seed gives bit-identical weights.

    The caller's torch RNG state is left as it was.
    """
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    config = build_config(variant, kv_heads=kv_heads, width=width)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    ids = SPECIAL_TOKEN_IDS
    # Qwen2-VL-*-Instruct stops at either end token.
    model.generation_config = GenerationConfig(
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
        pad_token_id=ids["<|endoftext|>"],
        do_sample=False,
    )
    return model.eval()


def recipe_id() -> str:
    """Names what a build depends on besides variant and seed: this file, the corpus and the library versions."""
    import tokenizers
    import torch
    import transformers

    digest = hashlib.sha256(pathlib.Path(__file__).read_bytes())
    digest.update(pathlib.Path(__file__).with_name("tiny_llava.py").read_bytes())
    digest.update(corpus_path().read_bytes())
    digest.update(f"{torch.__version__} {transformers.__version__} {tokenizers.__version__}".encode())
    return digest.hexdigest()[:16]


def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    variant: str = "qwen2_vl",
    seed: int = 0,
    kv_heads: int = DEFAULT_KV_HEADS,
    width: str = "tiny",
) -> pathlib.Path:
    """Builds the tiny model of `variant` into `out_dir` (created if missing) and returns its path.

    The same seed gives bit-identical weights and identical tokenizer files. The marker file is written last.
    """
    _check_variant(variant, width)
    _check_kv_heads(kv_heads)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER_FILE).unlink(missing_ok=True)
    processor = build_processor(variant)
    build_model(variant, seed=seed, kv_heads=kv_heads, width=width).save_pretrained(out)
    if variant == "llava":  # its processor_config.json holds the patch size and feature strategy tokens need
        processor.save_pretrained(out)
        (out / MARKER_FILE).write_text(json.dumps(_marker(variant, seed, kv_heads, width), sort_keys=True) + "\n")
        return out
    # The file layout of a Hub Qwen2-VL checkpoint: preprocessor_config.json naming the processor class, next to
    # the tokenizer files and chat_template.jinja (not 5.x's processor_config.json).
    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    _add_json_fields(out / "preprocessor_config.json", processor_class=_processor_class(variant).__name__)
    (out / "video_preprocessor_config.json").write_text(
        json.dumps(video_processor_settings(variant), indent=2, sort_keys=True) + "\n"
    )
    (out / MARKER_FILE).write_text(json.dumps(_marker(variant, seed, kv_heads, width), sort_keys=True) + "\n")
    return out


def _marker(variant: str, seed: int, kv_heads: int, width: str = "tiny") -> dict:
    marker = {"variant": variant, "seed": seed, "kv_heads": kv_heads, "recipe": recipe_id()}
    if width != "tiny":  # the tiny build's marker stays as it was
        marker["width"] = width
    return marker


def _add_json_fields(path: pathlib.Path, **fields) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _complete(path: pathlib.Path, variant: str, seed: int, kv_heads: int, width: str = "tiny") -> bool:
    """Whether `path` holds the finished build of (variant, seed); raises if it holds another one."""
    try:
        built = json.loads((path / MARKER_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return False
    wanted = _marker(variant, seed, kv_heads, width)
    if built != wanted:
        raise ValueError(f"{path} holds the tiny model {built}, not {wanted}; delete it or pass another folder")
    return True


def _stale(path: pathlib.Path, variant: str, seed: int, kv_heads: int, width: str) -> bool:
    """Whether `path` holds this very tiny model built by an older recipe (another version of this file, the corpus
    or the libraries): the same variant, seed, KV heads and width, another ``recipe``."""
    try:
        built = json.loads((path / MARKER_FILE).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return False
    wanted = _marker(variant, seed, kv_heads, width)
    same = {k: v for k, v in built.items() if k != "recipe"} == {k: v for k, v in wanted.items() if k != "recipe"}
    return same and built.get("recipe") != wanted["recipe"]


def ensure_tiny_model(
    out_dir: str | os.PathLike,
    *,
    variant: str = "qwen2_vl",
    seed: int = 0,
    kv_heads: int = DEFAULT_KV_HEADS,
    width: str = "tiny",
    replace_stale: bool = False,
) -> pathlib.Path:
    """Returns `out_dir` once it holds the complete tiny model, building it only if it does not yet.

    The build goes to a temporary sibling folder that is renamed into place, so concurrent callers (test workers,
    the ranks of one group) never see a half-written folder; the loser of a race discards its copy.
    ``replace_stale``: a folder holding the same model built by an older recipe is rebuilt instead of refused — for
    folders mmcast owns (the demo's, the benchmarks' caches), which an upgrade would otherwise leave unusable.
    """
    _check_variant(variant, width)
    _check_kv_heads(kv_heads)
    out = pathlib.Path(out_dir)
    if replace_stale and _stale(out, variant, seed, kv_heads, width):
        old = out.with_name(f".{out.name}.stale-{os.getpid()}")
        os.rename(out, old)  # out of the way first: a concurrent reader sees a missing folder, never a mixed one
        shutil.rmtree(old, ignore_errors=True)
    if _complete(out, variant, seed, kv_heads, width):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        build_tiny_model(tmp, variant=variant, seed=seed, kv_heads=kv_heads, width=width)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            # rename(2) replaces a missing or empty directory atomically and fails on a non-empty one.
            os.rename(tmp, out)
        except OSError:
            if not _complete(
                out, variant, seed, kv_heads, width
            ):  # another caller's build won the race, or a foreign folder
                raise FileExistsError(
                    f"{out} is not empty but holds no complete tiny model; delete it or pass another folder"
                ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
