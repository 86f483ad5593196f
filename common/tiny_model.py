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

from common.tiny_recipe import (
    CHAT_TEMPLATE,
    DEFAULT_KV_HEADS,
    FIRST_SPECIAL_ID,
    HEAD64_WIDTH,
    IMAGE_PROCESSOR_SETTINGS,
    KV_HEAD_CHOICES,
    MARKER_FILE,
    PRETOKENIZE_REGEX,
    QWEN3_IMAGE_PROCESSOR_SETTINGS,
    QWEN3_REAL_WIDTH,
    QWEN3_TEXT,
    REAL_WIDTH,
    SPECIAL_TOKEN_IDS,
    SPECIAL_TOKENS,
    TEXT_CONFIG,
    VARIANTS,
    VIDEO_COMMON,
    VIDEO_PROCESSOR_SETTINGS,
    VISION_CONFIGS,
    VOCAB_SIZE,
    WIDTHS,
)


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
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=FIRST_SPECIAL_ID,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train([str(corpus_path())], trainer)
    if bpe.get_vocab_size() != FIRST_SPECIAL_ID:
        # A shorter corpus would shift every special id; the config below hard-codes them.
        raise RuntimeError(
            f"{corpus_path()} trains only {bpe.get_vocab_size()} BPE tokens, {FIRST_SPECIAL_ID} are needed; "
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
        model_max_length=TEXT_CONFIG["max_position_embeddings"],
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

        return tiny_llava.build_config(TEXT_CONFIG, token_ids, kv_heads)
    if variant == "qwen2_vl":
        from transformers import Qwen2VLConfig as config_class
    elif variant == "qwen3_vl":
        from transformers import Qwen3VLConfig as config_class
    else:
        from transformers import Qwen2_5_VLConfig as config_class
    if width != "tiny":
        widths = HEAD64_WIDTH if width == "head64" else QWEN3_REAL_WIDTH if variant == "qwen3_vl" else REAL_WIDTH
        text = {**TEXT_CONFIG, **widths["text"]}
        if variant == "qwen3_vl":
            text = {k: v for k, v in text.items() if k not in ("use_sliding_window", "max_window_layers")}
        return config_class(
            text_config=text,
            vision_config={**VISION_CONFIGS[variant], **widths["vision"]},
            tie_word_embeddings=widths["tie_word_embeddings"],
            dtype="float32",
            **token_ids,
        )
    text = {**TEXT_CONFIG, "num_key_value_heads": kv_heads}
    if variant == "qwen3_vl":
        text = {k: v for k, v in text.items() if k not in ("use_sliding_window", "max_window_layers")}
        text.update(QWEN3_TEXT)
    return config_class(
        text_config=text,
        vision_config=dict(VISION_CONFIGS[variant]),
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


def video_processor_settings(variant: str) -> dict | None:
    """The ``video_preprocessor_config.json`` of `variant` as a dict; None for a variant without video (LLaVA)."""
    _check_variant(variant)
    if variant == "llava":
        return None
    own = VIDEO_PROCESSOR_SETTINGS["qwen3_vl" if variant == "qwen3_vl" else "qwen2_vl"]
    return {**VIDEO_COMMON, **own, "processor_class": _processor_class(variant).__name__}


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
    """Names what a build depends on besides variant and seed: this file, its recipe and LLaVA modules, the corpus
    and the library versions."""
    import tokenizers
    import torch
    import transformers

    digest = hashlib.sha256(pathlib.Path(__file__).read_bytes())
    digest.update(pathlib.Path(__file__).with_name("tiny_recipe.py").read_bytes())
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
