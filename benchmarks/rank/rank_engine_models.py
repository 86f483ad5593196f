"""The rank-engine comparison's checkpoints (``rank_engine.py``): 2-layer Qwen2-VL and Qwen3-VL at real widths with
random weights, float32, each built once under ``benchmarks/results/.model``: Qwen2-VL-2B's and Qwen3-VL-2B's widths
from ``common.tiny_model``, Qwen2-VL-7B's decoder widths built here on the 2B recipe."""

from __future__ import annotations

import json
import os

from benchmarks.support.paths import RESULTS

MODELS = os.path.join(RESULTS, ".model")
# Qwen2-VL-7B-Instruct's config.json widths; 2 decoder layers, the 2B-width recipe's 2 vision blocks.
WIDTH_7B = {
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
}


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
    out = os.path.join(MODELS, "qwen2_vl-7b-width")
    marker = os.path.join(out, "mmcast_rank_engine.json")
    wanted = {"widths": WIDTH_7B, "recipe": tiny_model.recipe_id()}
    if os.path.exists(marker) and json.load(open(marker)) == wanted:
        return out
    _build_7b(out)
    with open(marker, "w") as f:
        json.dump(wanted, f)
    return out


def _build_7b(out: str) -> None:
    """The 2B-width recipe (tokenizer, processor, vision tower) with Qwen2-VL-7B's decoder widths."""
    import torch
    from transformers import AutoModelForImageTextToText

    from common import tiny_model

    config = tiny_model.build_config(width="real")
    for key, value in WIDTH_7B.items():
        setattr(config.text_config, key, value)
    config.vision_config.hidden_size = WIDTH_7B["hidden_size"]  # the merger's output: the decoder's width
    config.tie_word_embeddings = config.text_config.tie_word_embeddings = False
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
