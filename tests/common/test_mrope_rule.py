"""One M-RoPE rule for the scheduler (what a stripped item keeps) and the ranks (how positions are computed)."""

import json

import pytest
from transformers import LlamaConfig, Qwen2_5_VLConfig, Qwen2Config, Qwen2VLConfig

import common.families
import common.mrope
import scheduler_svc.engine.frontend
from common.families import uses_mrope

HUB_ROPE_SCALING = {"type": "mrope", "mrope_section": [16, 24, 24]}  # what Qwen2-VL / Qwen2.5-VL checkpoints write


def _as_json(config) -> dict:
    """The config as a checkpoint's config.json holds it (what a rank reads before any weight)."""
    return json.loads(config.to_json_string())


@pytest.mark.parametrize("cls", (Qwen2VLConfig, Qwen2_5_VLConfig))
@pytest.mark.parametrize("hub_style", (False, True))
def test_the_qwen2_vl_family_is_mrope_in_every_form(cls, hub_style):
    # transformers' defaults carry no mrope_section; Hub checkpoints carry one in rope_scaling: both are M-RoPE.
    text = {"rope_scaling": HUB_ROPE_SCALING} if hub_style else {}
    config = cls(text_config=text)
    assert uses_mrope(config)
    assert uses_mrope(config.text_config)  # a rank that holds only the text part decides the same
    assert uses_mrope(_as_json(config))


@pytest.mark.parametrize(
    "config",
    (
        Qwen2Config(vocab_size=32, hidden_size=16, num_attention_heads=2, num_hidden_layers=1),
        LlamaConfig(vocab_size=32, hidden_size=16, num_attention_heads=2, num_hidden_layers=1),
    ),
    ids=("qwen2", "llama"),
)
def test_plain_rope_models_are_not_mrope(config):
    assert not uses_mrope(config)
    assert not uses_mrope(_as_json(config))
    assert not uses_mrope({"model_type": "llava", "text_config": _as_json(config)})


def test_an_unknown_model_type_with_mrope_sections_is_mrope():
    # Whichever level the section is written at, and also nested per layer type.
    section = {"rope_type": "default", "mrope_section": [2, 3, 3]}
    assert uses_mrope({"model_type": "other", "rope_parameters": section})
    assert uses_mrope({"model_type": "other", "text_config": {"rope_scaling": section}})
    assert uses_mrope({"model_type": "other", "text_config": {"rope_parameters": {"full_attention": section}}})
    assert not uses_mrope({"model_type": "other", "text_config": {"rope_parameters": {"rope_type": "default"}}})
    assert not uses_mrope({})


def test_both_sides_use_the_shared_rule():
    # The frontend decides what stripped items keep, the ranks how positions are computed: the same function.
    assert scheduler_svc.engine.frontend.uses_mrope is common.families.uses_mrope
    assert common.mrope.uses_mrope is common.families.uses_mrope
