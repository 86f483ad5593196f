"""The rank-engine comparison's checkpoints (``rank_engine.py``): 2-layer Qwen2-VL and Qwen3-VL at real widths with
random weights, float32, each built once under ``benchmarks/results/.model``: Qwen2-VL-2B's and Qwen3-VL-2B's widths
from ``common.tiny_model``; built here on the 2B recipe, Qwen2-VL-7B's decoder widths (``7b``) and Qwen2-VL-2B's
widths with the tokenizer's own 1,024-token vocabulary (``2b-vocab1k``: the decoder's layers without a 151,936-row
``lm_head``, which is most of a 2B-width decode step's weights)."""

from __future__ import annotations

import json
import os

from benchmarks.support.paths import RESULTS
from common.tiny_recipe import VOCAB_SIZE

MODELS = os.path.join(RESULTS, ".model")
# Qwen2-VL-7B-Instruct's config.json widths; 2 decoder layers, the 2B-width recipe's 2 vision blocks.
WIDTH_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}
# Qwen2-VL-2B's widths (``common.tiny_model``'s ``width="real"``) with the tokenizer's vocabulary: every id it
# produces, its special tokens included, is below 1,024.
WIDTH_2B_VOCAB1K = {"vocab_size": VOCAB_SIZE}


def model_dir(width: str) -> str:
    from common import tiny_model

    if width == "2b":
        return str(
            tiny_model.ensure_tiny_model(os.path.join(MODELS, "qwen2_vl-real-width"), width="real", replace_stale=True)
        )
    if width == "qwen3-2b":
        return str(
            tiny_model.ensure_tiny_model(
                os.path.join(MODELS, "qwen3_vl-real-width"), variant="qwen3_vl", width="real", replace_stale=True
            )
        )
    if width == "2b-vocab1k":
        return _built(os.path.join(MODELS, "qwen2_vl-2b-width-vocab1k"), WIDTH_2B_VOCAB1K, tied=True)
    if width == "7b":
        return _built(os.path.join(MODELS, "qwen2_vl-7b-width"), WIDTH_7B, tied=False)
    raise ValueError(f"width {width!r}: one of 2b, 2b-vocab1k, 7b, qwen3-2b")


def _built(out: str, widths: dict, tied: bool) -> str:
    from common import tiny_model

    marker = os.path.join(out, "mmcast_rank_engine.json")
    wanted = {"widths": widths, "tied": tied, "recipe": tiny_model.recipe_id()}
    if os.path.exists(marker) and json.load(open(marker)) == wanted:
        return out
    _build(out, widths, tied)
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return out


def _build(out: str, widths: dict, tied: bool) -> None:
    """The 2B-width recipe (tokenizer, processor, vision tower) with ``widths`` for the decoder."""
    import torch
    from transformers import AutoModelForImageTextToText

    from common import tiny_model

    config = tiny_model.build_config(width="real")
    for key, value in widths.items():
        setattr(config.text_config, key, value)
    config.vision_config.hidden_size = config.text_config.hidden_size  # the merger's output: the decoder's width
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = tied
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = tiny_model.build_model().generation_config
    model.save_pretrained(out)
    del model
    processor = tiny_model.build_processor()
    processor.tokenizer.save_pretrained(out)
    processor.image_processor.save_pretrained(out)
    path = os.path.join(out, "preprocessor_config.json")
    data = json.load(open(path))
    data["processor_class"] = type(processor).__name__
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
