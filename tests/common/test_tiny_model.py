"""The embedded tiny Qwen2-VL / Qwen2.5-VL / Qwen3-VL: deterministic builds, the from_pretrained round trip, the
processor's placeholder spans, generation, and the shape constraints tensor parallelism relies on (the tiny LLaVA's:
tests/common/test_tiny_llava.py)."""

import concurrent.futures
import json
import pathlib
import shutil
import threading

import numpy as np
import pytest
import tokenizers
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from common import tiny_model
from common.families import family_of
from common.processor import load_processor
from common.tiny_model import (
    MARKER_FILE,
    SPECIAL_TOKEN_IDS,
    VOCAB_SIZE,
    build_config,
    build_model,
    build_tiny_model,
    ensure_tiny_model,
)

VARIANTS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")  # the Qwen-VL ones; LLaVA has its own file
IMAGE_PAD = SPECIAL_TOKEN_IDS["<|image_pad|>"]
VISION_START = SPECIAL_TOKEN_IDS["<|vision_start|>"]
VISION_END = SPECIAL_TOKEN_IDS["<|vision_end|>"]

TWO_IMAGE_CHAT = [
    {
        "role": "user",
        "content": [
            {"type": "image"},
            {"type": "text", "text": "What colour is the boat?"},
            {"type": "image"},
            {"type": "text", "text": "And in this picture?"},
        ],
    }
]


def gradient(width: int, height: int, shift: int = 0) -> Image.Image:
    """A smooth RGB gradient; `shift` gives a different image of the same size."""
    y, x = np.mgrid[0:height, 0:width]
    red = (x * 255 // max(width - 1, 1) + shift) % 256
    green = y * 255 // max(height - 1, 1)
    blue = (x + y) * 128 // (width + height)
    return Image.fromarray(np.stack([red, green, blue], axis=-1).astype(np.uint8))


def runs_of(ids: torch.Tensor, token_id: int) -> list[tuple[int, int]]:
    """(start, length) of every maximal run of `token_id` in a 1-D tensor."""
    runs: list[tuple[int, int]] = []
    for pos in (ids == token_id).nonzero().flatten().tolist():
        if runs and runs[-1][0] + runs[-1][1] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((pos, 1))
    return runs


@pytest.fixture(scope="module", params=VARIANTS)
def variant_dir(request, tiny_model_dir, tiny_model_25_dir, tiny_model_q3_dir) -> pathlib.Path:
    return {"qwen2_vl": tiny_model_dir, "qwen2_5_vl": tiny_model_25_dir, "qwen3_vl": tiny_model_q3_dir}[request.param]


def file_bytes(folder: pathlib.Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_same_seed_builds_identical_files_and_another_seed_other_weights(tmp_path, tiny_model_dir):
    again = build_tiny_model(tmp_path / "again", variant="qwen2_vl", seed=0)
    assert file_bytes(again) == file_bytes(tiny_model_dir)
    other = build_tiny_model(tmp_path / "other", variant="qwen2_vl", seed=1)
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_folder_has_the_layout_of_a_hub_checkpoint(variant_dir):
    names = {path.name for path in variant_dir.iterdir()}
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "preprocessor_config.json",
        "video_preprocessor_config.json",
        MARKER_FILE,
    } <= names
    video = json.loads((variant_dir / "video_preprocessor_config.json").read_text())
    assert video["cap_pixels_per_frame"] is False and video["do_sample_frames"] is True and video["fps"] == 2.0
    assert (
        video["processor_class"]
        == json.loads((variant_dir / "preprocessor_config.json").read_text())["processor_class"]
    )
    preprocessor = json.loads((variant_dir / "preprocessor_config.json").read_text())
    assert preprocessor["processor_class"] in ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")
    assert preprocessor["size"] == {"shortest_edge": 3136, "longest_edge": 12845056}
    assert sum(path.stat().st_size for path in variant_dir.iterdir()) < 4 * 2**20


@pytest.mark.parametrize("variant", VARIANTS)
def test_reload_gives_bit_identical_parameters(variant, tiny_model_dir, tiny_model_25_dir, tiny_model_q3_dir):
    folder = {"qwen2_vl": tiny_model_dir, "qwen2_5_vl": tiny_model_25_dir, "qwen3_vl": tiny_model_q3_dir}[variant]
    built = build_model(variant, seed=0).state_dict()
    loaded = AutoModelForImageTextToText.from_pretrained(folder).state_dict()
    assert built.keys() == loaded.keys()
    for name, tensor in built.items():
        assert loaded[name].dtype == torch.float32, name
        assert torch.equal(tensor, loaded[name]), name


def test_build_leaves_the_callers_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("qwen2_vl", seed=7)
    assert torch.equal(torch.rand(3), expected)


def test_special_tokens_agree_between_tokenizer_and_config(variant_dir):
    tokenizer = AutoTokenizer.from_pretrained(variant_dir)
    config = AutoConfig.from_pretrained(variant_dir)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert len(tokenizer) == config.text_config.vocab_size == VOCAB_SIZE
    for token, token_id in SPECIAL_TOKEN_IDS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id, token
        assert tokenizer.encode(token, add_special_tokens=False) == [token_id], token
    assert config.image_token_id == IMAGE_PAD
    assert config.video_token_id == SPECIAL_TOKEN_IDS["<|video_pad|>"]
    assert config.vision_start_token_id == VISION_START
    assert config.vision_end_token_id == VISION_END
    assert tokenizer.eos_token_id == config.text_config.eos_token_id == SPECIAL_TOKEN_IDS["<|im_end|>"]
    assert tokenizer.pad_token_id == config.text_config.pad_token_id == SPECIAL_TOKEN_IDS["<|endoftext|>"]


def test_tokenizer_is_a_real_byte_level_bpe(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "The red boat rocked against the pier. Café, 東京 and 😀 survive as bytes.\n\tDone!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer.encode("The morning light", add_special_tokens=False)) == 3  # merged whole words
    assert max(ids) < SPECIAL_TOKEN_IDS["<|endoftext|>"]
    # transformers 5.x rebuilds the pipeline from vocab and merges; it must match the tokenizer.json as trained.
    raw = tokenizers.Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    corpus = tiny_model.corpus_path().read_text()
    assert tokenizer.encode(corpus, add_special_tokens=False) == raw.encode(corpus).ids


def test_chat_template_renders_the_qwen2_vl_format(tiny_model_dir):
    processor = load_processor(tiny_model_dir)
    text = processor.apply_chat_template(TWO_IMAGE_CHAT, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What colour is the boat?"
        "<|vision_start|><|image_pad|><|vision_end|>And in this picture?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]},
    ]
    assert processor.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    )


def test_processor_expands_each_image_into_its_placeholder_span(variant_dir):
    processor = load_processor(variant_dir)
    text = processor.apply_chat_template(TWO_IMAGE_CHAT, tokenize=False, add_generation_prompt=True)
    # PIL sizes are (width, height): 56x84 stays 84x56 pixels -> 6x4 patches; 112x56 -> 4x8 patches.
    inputs = processor(text=[text], images=[gradient(56, 84), gradient(112, 56)], return_tensors="pt")
    assert inputs["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 8]]
    patch = processor.image_processor.patch_size  # 14 (Qwen2-VL, Qwen2.5-VL) or 16 (Qwen3-VL): same grids here
    assert tuple(inputs["pixel_values"].shape) == (6 * 4 + 4 * 8, 3 * 2 * patch * patch)
    ids = inputs["input_ids"][0]
    runs = runs_of(ids, IMAGE_PAD)
    merge = processor.image_processor.merge_size
    assert [length for _, length in runs] == [int(g.prod()) // merge**2 for g in inputs["image_grid_thw"]] == [6, 8]
    for start, length in runs:
        assert ids[start - 1] == VISION_START and ids[start + length] == VISION_END
    assert torch.equal(inputs["mm_token_type_ids"][0], (ids == IMAGE_PAD).long())


def test_a_720p_image_gives_the_qwen2_vl_2b_grid(tiny_model_dir):
    image_processor = load_processor(tiny_model_dir).image_processor
    out = image_processor(images=[gradient(1280, 720)], return_tensors="pt")
    assert tuple(out["pixel_values"].shape) == (4784, 1176)
    assert out["image_grid_thw"].tolist() == [[1, 52, 92]]
    assert int(out["image_grid_thw"].prod()) // 4 == 1196


def test_greedy_generate_runs_and_sees_the_images(variant_dir):
    processor = load_processor(variant_dir)
    model = AutoModelForImageTextToText.from_pretrained(variant_dir).eval()
    text = processor.apply_chat_template(TWO_IMAGE_CHAT, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[gradient(56, 84), gradient(112, 56)], return_tensors="pt")
    prompt_len = inputs["input_ids"].shape[1]
    with torch.no_grad():
        first = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        second = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        assert first.shape == (1, prompt_len + 8)
        assert torch.equal(first, second)
        # Negative control for oracle tests: another first image must move the log-probabilities clearly.
        swapped = processor(text=[text], images=[gradient(56, 84, shift=90), gradient(112, 56)], return_tensors="pt")
        logprobs = model(**inputs).logits[0, -1].log_softmax(-1)
        swapped_logprobs = model(**swapped).logits[0, -1].log_softmax(-1)
    assert (logprobs - swapped_logprobs).abs().max() > 0.05


@pytest.mark.parametrize("variant", VARIANTS)
def test_shapes_divide_for_tensor_parallel_sizes_up_to_4(variant):
    config = build_config(variant)
    text, vision = config.text_config, config.vision_config
    head_dim = text.hidden_size // text.num_attention_heads
    assert head_dim == 16
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert text.max_position_embeddings >= 32768 + 1024
    # Qwen3-VL's own plan shards only the embedding; its family supplies the decoder's (common/families/qwen3_vl.py)
    plan = family_of(config).tp_plan(config, 2) or type(text).base_model_tp_plan
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= {key.split(".")[-1] for key in plan}
    for tp_size in (1, 2, 4):
        for name in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size", "vocab_size"):
            assert getattr(text, name) % tp_size == 0, (name, tp_size)
        assert vision.num_heads % tp_size == 0
    assert not config.tie_word_embeddings  # lm_head is sharded colwise while embed_tokens stays whole


def test_real_width_config_has_qwen2_vl_2b_widths_and_two_layers():
    config = build_config("qwen2_vl", width="real")
    text, vision = config.text_config, config.vision_config
    got = {
        name: getattr(text, name)
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "num_hidden_layers",
        )
    }
    assert got == {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "num_hidden_layers": 2,
    }
    assert sum(text.rope_parameters["mrope_section"]) == 1536 // 12 // 2
    assert (vision.embed_dim, vision.num_heads, vision.mlp_ratio, vision.hidden_size) == (1280, 16, 4, 1536)
    assert config.tie_word_embeddings
    # the special token ids of the tiny tokenizer lie inside the large vocabulary
    assert max(SPECIAL_TOKEN_IDS.values()) < text.vocab_size
    with pytest.raises(ValueError, match="width="):
        build_config("qwen2_vl", width="huge")
    with pytest.raises(ValueError, match="variant='qwen2_5_vl' is neither"):
        build_config("qwen2_5_vl", width="real")
    with pytest.raises(ValueError, match="variant='qwen3_vl' must be 'qwen2_vl'"):
        build_config("qwen3_vl", width="head64")


def test_real_width_qwen3_config_has_qwen3_vl_2b_widths_and_deepstack():
    config = build_config("qwen3_vl", width="real")
    text, vision = config.text_config, config.vision_config
    got = {
        name: getattr(text, name)
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
            "num_hidden_layers",
        )
    }
    assert got == {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "num_hidden_layers": 2,
    }
    assert text.rope_parameters["mrope_interleaved"] and sum(text.rope_parameters["mrope_section"]) == 128 // 2
    assert (vision.hidden_size, vision.num_heads, vision.out_hidden_size) == (1024, 16, 2048)
    assert list(vision.deepstack_visual_indexes) == [0, 1] and vision.depth == 2
    assert config.tie_word_embeddings


def test_head64_config_has_heads_of_width_64_that_tp_2_shards():
    # vLLM's CPU attention (benchmarks/peer/compare.py) has kernels from head size 32 up, not for the tiny model's 16.
    config = build_config("qwen2_vl", width="head64")
    text, vision = config.text_config, config.vision_config
    assert text.hidden_size // text.num_attention_heads == 64
    assert vision.embed_dim // vision.num_heads == 64
    assert sum(text.rope_parameters["mrope_section"]) == 64 // 2
    assert vision.hidden_size == text.hidden_size  # the merger's output is the decoder's width
    assert (text.num_hidden_layers, vision.depth, text.vocab_size) == (2, 2, 1024)
    for name in ("num_attention_heads", "num_key_value_heads", "hidden_size", "intermediate_size"):
        assert getattr(text, name) % 2 == 0, name
    assert vision.num_heads % 2 == 0
    assert not config.tie_word_embeddings


def test_qwen2_5_vl_vision_tower_uses_windows_on_small_images():
    vision = build_config("qwen2_5_vl").vision_config
    window_in_merged_patches = vision.window_size // (vision.patch_size * vision.spatial_merge_size)
    assert window_in_merged_patches == 2  # a 4x8-patch image (2x4 merged) spans two windows
    assert list(vision.fullatt_block_indexes) == [vision.depth - 1]
    assert vision.out_hidden_size == build_config("qwen2_5_vl").text_config.hidden_size


def test_ensure_returns_a_complete_folder_without_building(tiny_model_dir, monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt a complete folder")

    monkeypatch.setattr(tiny_model, "build_tiny_model", no_build)
    assert ensure_tiny_model(tiny_model_dir) == tiny_model_dir


def test_ensure_refuses_another_build_and_foreign_folders(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="seed"):
        ensure_tiny_model(tiny_model_dir, seed=1)
    with pytest.raises(ValueError, match="variant"):
        ensure_tiny_model(tiny_model_dir, variant="qwen2_5_vl")
    with pytest.raises(ValueError, match="variant='gemma3'"):
        ensure_tiny_model(tmp_path / "x", variant="gemma3")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="delete it or pass another folder"):
        ensure_tiny_model(foreign)
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


def test_a_build_of_an_older_recipe_is_refused_unless_replace_stale(tiny_model_dir, tmp_path):
    stale = tmp_path / "stale"
    shutil.copytree(tiny_model_dir, stale)
    marker = json.loads((stale / MARKER_FILE).read_text())
    (stale / MARKER_FILE).write_text(json.dumps({**marker, "recipe": "0123456789abcdef"}))
    with pytest.raises(ValueError, match="delete it or pass another folder"):
        ensure_tiny_model(stale)
    with pytest.raises(ValueError, match="seed"):  # another model, not an older build of this one: still refused
        ensure_tiny_model(stale, seed=1, replace_stale=True)
    assert ensure_tiny_model(stale, replace_stale=True) == stale
    assert json.loads((stale / MARKER_FILE).read_text()) == marker  # rebuilt by the current recipe
    assert (stale / "config.json").read_bytes() == (tiny_model_dir / "config.json").read_bytes()
    assert [path.name for path in tmp_path.iterdir() if path.name.startswith(".")] == []


def test_concurrent_ensure_calls_publish_exactly_one_complete_folder(tmp_path, monkeypatch):
    callers = 3
    all_built = threading.Barrier(callers, timeout=10)

    def fake_build(out_dir, *, variant, seed, kv_heads, width):
        out = pathlib.Path(out_dir)
        (out / "model.safetensors").write_text(out.name)
        (out / MARKER_FILE).write_text(json.dumps(tiny_model._marker(variant, seed, kv_heads, width)))
        all_built.wait()  # every caller has built its own copy before any of them renames
        return out

    monkeypatch.setattr(tiny_model, "build_tiny_model", fake_build)
    target = tmp_path / "model"
    with concurrent.futures.ThreadPoolExecutor(max_workers=callers) as pool:
        results = list(pool.map(lambda _: ensure_tiny_model(target), range(callers)))
    assert results == [target] * callers
    assert [path.name for path in tmp_path.iterdir()] == ["model"]  # the losers' copies are gone
    assert (target / "model.safetensors").read_text().startswith(".model.building-")
    assert oct((target).stat().st_mode & 0o777) == oct(0o755)
