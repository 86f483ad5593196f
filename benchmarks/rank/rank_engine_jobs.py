"""The rank-engine comparison's jobs (``rank_engine.py``): N concurrent text requests with equal or mixed prompt
lengths, or 16 at one context length, per checkpoint width; the plans that group them (``--quick``, the full run);
and each request's prompt, built to its target token count."""

from __future__ import annotations

import dataclasses

MIXED = (256, 512, 1024, 2048, 4096)


@dataclasses.dataclass(frozen=True)
class Job:
    name: str  # "equal" | "mixed" | "context"
    n: int
    lengths: tuple[int, ...]  # target prompt tokens per request
    new_tokens: int


@dataclasses.dataclass(frozen=True)
class Plan:
    width: str  # "2b" | "2b-vocab1k" | "7b" | "qwen3-2b" (rank_engine_models)
    jobs: tuple[Job, ...]


def _jobs(ns, equal: int, new_tokens: int, mixed_ns, contexts, context_tokens: int) -> tuple[Job, ...]:
    jobs = [Job("equal", n, (equal,) * n, new_tokens) for n in ns]
    jobs += [Job("mixed", n, tuple(MIXED[i % len(MIXED)] for i in range(n)), new_tokens) for n in mixed_ns]
    jobs += [Job("context", 16, (c,) * 16, context_tokens) for c in contexts]
    return tuple(jobs)


PLANS = {
    # make bench-quick: 2B widths, the two targets' jobs (N = 16 equal and mixed), N = 1, and a 256-token context
    # (N = 16 equal is the 1k row of the attended-token table); N = 16 equal on the 1,024-token vocabulary.
    "quick": (Plan("2b", _jobs((1, 16), 1024, 16, (16,), (256,), 8)),
              Plan("2b-vocab1k", _jobs((16,), 1024, 16, (), (), 8))),
    # make bench: every N at 2B widths, 4k context included. 7B widths: the jobs whose static batch fits beside the
    # rank in 24 GiB (transformers prefills a job in one forward: 16 x 4k tokens at 7B widths holds ~15 GB of MLP
    # activations alone); prefill there costs ~4x.
    "full": (Plan("2b", _jobs((1, 4, 16, 32), 1024, 24, (4, 16, 32), (256, 4096), 8)),
             Plan("7b", _jobs((1, 16), 1024, 24, (4,), (256,), 8)),
             Plan("2b-vocab1k", _jobs((1, 16), 1024, 24, (16,), (256,), 8)),
             Plan("qwen3-2b", _jobs((1, 16), 1024, 24, (16,), (256,), 8))),
}  # fmt: skip


def prompts(processor, job: Job, tag: str) -> list[tuple[str, list[int]]]:
    """(text, the frontend's token ids) per request, each ``job.lengths[i]`` tokens within a few, distinct from the
    first user token on (``tag`` and the index lead the text)."""
    from common import tiny_model

    words = open(tiny_model.corpus_path()).read().split()
    out = []
    for i, target in enumerate(job.lengths):
        head = f"Request {tag}-{i}: "
        count = target
        for _ in range(6):  # a few corrections: tokens per word vary
            text = head + " ".join(words[(i * 7919 + k) % len(words)] for k in range(count))
            ids = _ids(processor, text)
            if abs(len(ids) - target) <= 2:
                break
            count = max(1, int(count * target / len(ids)))
        out.append((text, ids))
    return out


def _ids(processor, text: str) -> list[int]:
    chat = [{"role": "user", "content": [{"type": "text", "text": text}]}]
    templated = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return processor(text=[templated], return_tensors="pt")["input_ids"][0].tolist()
