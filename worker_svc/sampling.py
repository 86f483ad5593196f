"""Token sampling on rank 0: greedy or temperature + top-p, reproducible per (request seed, token index).

The draw for output token ``i`` uses a fresh CPU generator seeded from ``(seed, i)``, so a request recomputed after
preemption or recovery repeats exactly the draws it made before. Log-probabilities are those of the unmodified
model distribution (``log_softmax`` of the raw logits), whatever temperature and top-p did to the draw.
"""

from __future__ import annotations

import dataclasses

import torch

_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive indices over the seed space


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = no nucleus cut
    seed: int = 0  # with the output token index, seeds the draw
    logprobs: int = 0  # top alternatives to return besides the sampled token
    return_logprobs: bool = False  # False: no log-probabilities at all


@dataclasses.dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float | None  # of token_id under the unmodified distribution; None unless asked
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of output token ``index`` of a request seeded ``seed``."""
    mixed = (seed * _GOLDEN + (index + 1) * (_GOLDEN >> 1)) & ((1 << 64) - 1)
    mixed ^= mixed >> 29
    return mixed & _MASK63


def sample(logits: torch.Tensor, params: SamplingParams, index: int) -> Sample:
    """One token from a ``[vocab]`` logits row. ``index`` is the output token index (0 for the first)."""
    logits = logits.detach().float()
    if params.temperature <= 0:
        token = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= params.top_p, 0.0)  # the first token always stays
            probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        generator = torch.Generator(device="cpu").manual_seed(draw_seed(params.seed, index))
        token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    if not params.return_logprobs:
        return Sample(token, None, [])
    logprobs = torch.log_softmax(logits, dim=-1)
    top: list[tuple[int, float]] = []
    if params.logprobs > 0:
        values, ids = torch.topk(logprobs, min(params.logprobs, logprobs.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return Sample(token, float(logprobs[token]), top)
