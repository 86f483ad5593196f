"""The embedded tiny LLaVA (common/tiny_llava.py): a Hub LLaVA folder that plain transformers loads, a fixed
placeholder count per image whatever its size, 1-D RoPE, and a decoder whose own tensor-parallel plan shards it at
TP 2 and 4; ``mmcast make-tiny-model --family llava`` builds it."""

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText

from common import tiny_llava
from common.families import family_of, uses_mrope
from common.model_checks import check_checkpoint
from common.processor import load_processor
from common.tiny_model import MARKER_FILE, SPECIAL_TOKEN_IDS, build_config, build_model
from mmcast_client import cli
from tests.common.test_tiny_model import TWO_IMAGE_CHAT, gradient, runs_of

IMAGE_PAD = SPECIAL_TOKEN_IDS["<|image_pad|>"]


def test_folder_is_a_hub_llava_checkpoint(tiny_model_llava_dir):
    names = {path.name for path in tiny_model_llava_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "processor_config.json",
        MARKER_FILE,
    } <= names
    processor_config = json.loads((tiny_model_llava_dir / "processor_config.json").read_text())
    assert processor_config["processor_class"] == "LlavaProcessor"
    assert (processor_config["patch_size"], processor_config["vision_feature_select_strategy"]) == (14, "default")
    config = AutoConfig.from_pretrained(tiny_model_llava_dir)
    assert (config.model_type, config.text_config.model_type, config.vision_config.model_type) == (
        "llava",
        "llama",
        "clip_vision_model",
    )
    assert family_of(config).name == "llava" and not uses_mrope(config)
    assert sum(path.stat().st_size for path in tiny_model_llava_dir.iterdir()) < 4 * 2**20


def test_reload_gives_bit_identical_parameters(tiny_model_llava_dir):
    built = build_model("llava", seed=0).state_dict()
    loaded = AutoModelForImageTextToText.from_pretrained(tiny_model_llava_dir).state_dict()
    assert type(AutoModelForImageTextToText.from_config(build_config("llava"))).__name__ == (
        "LlavaForConditionalGeneration"
    )
    assert built.keys() == loaded.keys()
    for name, tensor in built.items():
        assert torch.equal(tensor, loaded[name]), name


def test_every_image_is_nine_placeholders_and_one_crop(tiny_model_llava_dir):
    processor = load_processor(tiny_model_llava_dir)
    assert type(processor).__name__ == "LlavaProcessor"
    text = processor.apply_chat_template(TWO_IMAGE_CHAT, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[gradient(56, 84), gradient(300, 40)], return_tensors="pt")
    assert "image_grid_thw" not in inputs
    assert tuple(inputs["pixel_values"].shape) == (2, 3, tiny_llava.CROP, tiny_llava.CROP)
    runs = runs_of(inputs["input_ids"][0], IMAGE_PAD)
    assert [length for _, length in runs] == [tiny_llava.IMAGE_TOKENS] * 2 == [9, 9]


def test_greedy_generate_sees_the_images(tiny_model_llava_dir):
    processor = load_processor(tiny_model_llava_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_llava_dir).eval()
    text = processor.apply_chat_template(TWO_IMAGE_CHAT, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[gradient(56, 84), gradient(112, 56)], return_tensors="pt")
    swapped = processor(text=[text], images=[gradient(56, 84, shift=90), gradient(112, 56)], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        logprobs = model(**inputs).logits[0, -1].log_softmax(-1)
        swapped_logprobs = model(**swapped).logits[0, -1].log_softmax(-1)
    assert out.shape == (1, inputs["input_ids"].shape[1] + 8)
    assert (logprobs - swapped_logprobs).abs().max() > 0.05  # the oracle tests' negative control can fail


def test_decoder_shards_by_its_own_plan_at_tp_2_and_4(tiny_model_llava_dir):
    config = build_config("llava")
    text = config.text_config
    assert text.head_dim == 16 and "mrope_section" not in (text.rope_parameters or {})
    assert family_of(config).tp_plan(config, 2) is None  # the checkpoint's own plan
    with torch.device("meta"):  # the plan transformers composes for the whole model (what DistributedConfig applies)
        plan = AutoModelForImageTextToText.from_config(config).tp_plan
    decoder = "model.language_model.layers.*."
    assert {decoder + p: plan.get(decoder + p) for p in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")} == {
        decoder + "self_attn.q_proj": "colwise",
        decoder + "self_attn.k_proj": "colwise",
        decoder + "mlp.down_proj": "rowwise",
    }
    assert not any(key.startswith("model.vision_tower") for key in plan)  # the CLIP tower stays whole on every rank
    for tp_size in (1, 2, 4):
        check_checkpoint(tiny_model_llava_dir, tp_size, "--world-size")
        for name in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size", "vocab_size"):
            assert getattr(text, name) % tp_size == 0, (name, tp_size)
    assert not config.tie_word_embeddings


def test_make_tiny_model_builds_the_llava_family(tmp_path, tiny_model_llava_dir, capsys):
    out = tmp_path / "llava"
    assert cli.main(["make-tiny-model", str(out), "--family", "llava"]) == 0  # in-process: the command's own path
    assert capsys.readouterr().out.strip() == str(out)
    assert (out / "model.safetensors").read_bytes() == (tiny_model_llava_dir / "model.safetensors").read_bytes()
    assert json.loads((out / MARKER_FILE).read_text())["variant"] == "llava"


@pytest.mark.parametrize("kv_heads", [2])
def test_kv_heads_choice_applies_to_llava(kv_heads):
    assert build_config("llava", kv_heads=kv_heads).text_config.num_key_value_heads == kv_heads
