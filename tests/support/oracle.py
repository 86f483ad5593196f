"""The reference answers end-to-end tests compare with, and small helpers to read a running service.

``Oracle`` runs the checkpoint whole, without any cache, in plain transformers: greedy tokens with ``ignore_eos``
(a fixed length) and their log-probabilities. ``assert_matches`` is the comparison every served answer must pass
(tokens equal, log-probabilities within 1e-3). ``scrape`` reads one metric from a Prometheus text endpoint.
"""

from __future__ import annotations

import copy
import hashlib
import io
import threading
import time
import urllib.request

N_TOKENS = 8
LOGPROB_TOLERANCE = 1e-3
# What every oracle-checked request asks for: greedy, a fixed length, log-probabilities returned.
GENERATE = dict(max_tokens=N_TOKENS, ignore_eos=True, logprobs=0, temperature=0.0)


def user_turn(img: bytes | str, question: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": question}]}


class Oracle:
    """Greedy tokens and log-probabilities of the checkpoint run whole, without any cache, in plain transformers.

    Thread-safe; answers are memoized by (messages, n). A longer answer serves every shorter request of the same
    messages (greedy decoding is a prefix), so precomputing the longest length once covers the rest."""

    def __init__(self, model_dir) -> None:
        from transformers import AutoModelForImageTextToText

        from common.processor import load_processor

        self.processor = load_processor(model_dir)
        self.model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
        self._cache: dict[str, tuple[list[int], list[float]]] = {}
        self._lock = threading.Lock()

    def __call__(self, messages: list[dict], n: int = N_TOKENS) -> tuple[list[int], list[float]]:
        key = hashlib.sha256(repr(_key(messages)).encode()).hexdigest()
        with self._lock:
            known = self._cache.get(key)
            if known is None or len(known[0]) < n:
                known = self._cache[key] = self._run(messages, n)
            return known[0][:n], known[1][:n]

    def _run(self, messages: list[dict], n: int) -> tuple[list[int], list[float]]:
        hf_messages, images = [], []
        for message in messages:
            content = message["content"]
            if isinstance(content, str):
                content = [{"type": "text", "text": content}]
            parts = []
            for part in content:
                if part["type"] == "image":
                    images.append(image_as_sent(part["image"]))
                    parts.append({"type": "image"})
                else:
                    parts.append({"type": "text", "text": part["text"]})
            hf_messages.append({"role": message["role"], "content": parts})
        text = self.processor.apply_chat_template(hf_messages, add_generation_prompt=True)
        return self.generate(self.processor(text=[text], images=images or None, return_tensors="pt"), n)

    def generate(self, inputs, n: int = N_TOKENS) -> tuple[list[int], list[float]]:
        """Greedy tokens and log-probabilities after ``inputs`` (the processor's or tokenizer's tensors: a prompt the
        test rendered itself, e.g. a text prompt or a template call with other options). Not memoized."""
        import torch

        gen = copy.deepcopy(self.model.generation_config)
        gen.max_new_tokens, gen.do_sample = n, False
        gen.eos_token_id = []  # ignore_eos: a fixed length, and no suppression of end tokens the model picks
        gen.output_logits, gen.return_dict_in_generate = True, True
        with torch.inference_mode():
            out = self.model.generate(**inputs, generation_config=gen)
        tokens = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
        logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.logits, tokens, strict=True)]
        return tokens, logprobs


def image_as_sent(data: bytes):
    """The file as the user sent it, opened the way transformers' ``load_image`` opens it: Pillow decodes it and
    ``ImageOps.exif_transpose`` turns it upright. ``load_image`` then calls ``convert("RGB")``, which drops an alpha
    channel unblended; the processor's own ``convert_to_rgb`` composites it onto white, and that is the step this
    image is left to (tests/scheduler/test_image_modes.py shows it equal to ``processor(load_image(file))`` for every
    opaque image and to ``processor(Image.open(file))`` for every unturned one)."""
    from PIL import Image, ImageOps

    return ImageOps.exif_transpose(Image.open(io.BytesIO(data)))


def _key(messages):
    out = []
    for m in messages:
        content = m["content"] if isinstance(m["content"], list) else [{"type": "text", "text": m["content"]}]
        out.append(
            (
                m["role"],
                [hashlib.sha256(p["image"]).hexdigest() if p["type"] == "image" else p["text"] for p in content],
            )
        )
    return out


def mismatch(result, expected: tuple[list[int], list[float]]) -> str | None:
    """Why a served result differs from the oracle's answer, or None when it matches."""
    tokens, logprobs = expected
    served_tokens = list(result.token_ids)
    if served_tokens != tokens:
        pairs = zip(served_tokens, tokens, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(served_tokens), len(tokens)))
        return (
            f"tokens differ from index {first} (served {len(served_tokens)}, oracle {len(tokens)}): "
            f"served {served_tokens[first : first + 4]}, oracle {tokens[first : first + 4]}"
        )
    served = [lp.logprob for lp in result.logprobs]
    if len(served) != len(logprobs):
        return f"{len(served)} log-probabilities for {len(logprobs)} tokens"
    worst = max((abs(a - b) for a, b in zip(served, logprobs, strict=True)), default=0.0)
    if worst >= LOGPROB_TOLERANCE:
        return f"log-probabilities differ by up to {worst:.2e}"
    return None


def assert_matches(result, expected: tuple[list[int], list[float]], what: str = "") -> None:
    problem = mismatch(result, expected)
    assert problem is None, f"{what}: {problem}"


def scrape(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`, from a Prometheus text endpoint."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    total, seen = 0.0, False
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        found = dict(item.split("=", 1) for item in label_text.rstrip("}").split(",") if "=" in item)
        seen = True
        if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
            total += float(value)
    if not seen:
        raise KeyError(f"{url} exports no {name}")  # a renamed metric must not read as zero
    return total


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
