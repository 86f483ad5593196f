"""A step's penalties and biases (common/penalties.py) applied to its ``[batch, vocab]`` logits at once, on rank 0.

Every operation covers all the penalized rows together: the output tokens of every row are counted by one
``index_put_`` into a ``[rows, vocab]`` tensor, the prompt tokens marked by another, and the penalties are
elementwise ``where``/subtractions over that tensor; the per-request Python work is only the gathering of its token
ids. Rows without penalties are not touched (nor copied when no row has any).

Order (vLLM's): min_tokens and bad_words masking, logit_bias, repetition_penalty, frequency_penalty, presence_penalty. The
counts are over the request's output tokens so far: ``token_ids[num_prompt:]`` of the rank's state, which after a
preemption or recovery still holds the regenerated prefix as output (request_state.py takes ``num_prompt`` from
``NewRequest.num_output_tokens``), so a recomputed request is penalized exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from common.penalties import Penalties

History = tuple[Sequence[int], int]  # (prompt + output token ids so far, prompt length): the output follows it


def _pairs(rows: list[int], ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) index tensors of every id of ``ids[r]`` in row ``rows[r]``."""
    flat = [t for group in ids for t in group]
    index = [r for r, group in zip(rows, ids, strict=True) for _ in group]
    return torch.tensor(index, dtype=torch.long), torch.tensor(flat, dtype=torch.long)


def apply(
    logits: torch.Tensor, penalties: list[Penalties], indices: list[int], histories: Sequence[History | None]
) -> torch.Tensor:
    """``logits`` (``[n, vocab]`` float32) with each row's penalties applied; a new tensor when any row has
    penalties, else ``logits`` itself. ``indices[i]``: row i's output index (how many tokens it has out);
    ``histories[i]``: its tokens, needed for rows whose penalties count them (else may be None)."""
    active = [i for i, p in enumerate(penalties) if p.active]
    if not active:
        return logits
    out = logits.clone()
    whole = len(active) == logits.shape[0]
    sub = out if whole else out[active]
    chosen = [penalties[i] for i in active]
    vocab = logits.shape[1]

    masked = [(r, p.masked_until_min) for r, p in enumerate(chosen) if indices[active[r]] < p.min_tokens]
    masked += [(r, banned) for r, p in enumerate(chosen) if (banned := _banned(p, histories[active[r]]))]
    if masked:
        sub.index_put_(_pairs([r for r, _ in masked], [list(m) for _, m in masked]), torch.tensor(-math.inf))
    biased = [(r, p.logit_bias) for r, p in enumerate(chosen) if p.logit_bias]
    if biased:
        rows, ids = _pairs([r for r, _ in biased], [[t for t, _ in b] for _, b in biased])
        values = torch.tensor([v for _, b in biased for _, v in b], dtype=sub.dtype)
        sub.index_put_((rows, ids), values, accumulate=True)
    counting = [r for r, p in enumerate(chosen) if p.counts_output]
    if counting:
        sub[counting] = _penalize(
            sub[counting], [chosen[r] for r in counting], [histories[active[r]] for r in counting], vocab
        )
    if not whole:
        out[active] = sub
    return out


def _banned(p: Penalties, history: History | None) -> list[int]:
    """The last tokens of the bad words whose other tokens end the output so far (a loop over the words only)."""
    if not p.bad_word_ids:
        return []
    tokens, num_prompt = history
    out_len = len(tokens) - num_prompt
    banned = []
    for word in p.bad_word_ids:
        k = len(word) - 1
        if k <= out_len and (k == 0 or list(tokens[len(tokens) - k :]) == list(word[:k])):
            banned.append(word[-1])
    return banned


def _penalize(rows: torch.Tensor, chosen: list[Penalties], histories: list, vocab: int) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``rows`` (one per entry of ``chosen``)."""
    n = rows.shape[0]
    outputs = [list(h[0][h[1] :]) for h in histories]
    counts = torch.zeros((n, vocab), dtype=rows.dtype)
    counts.index_put_(_pairs(list(range(n)), outputs), torch.tensor(1.0, dtype=rows.dtype), accumulate=True)
    seen_out = counts > 0
    repeating = [r for r, p in enumerate(chosen) if p.repetition_penalty != 1.0]
    if repeating:
        seen = seen_out.clone()
        prompts = [list(histories[r][0][: histories[r][1]]) for r in repeating]
        seen.index_put_(_pairs(repeating, prompts), torch.tensor(True))
        rep = torch.tensor([p.repetition_penalty for p in chosen], dtype=rows.dtype).unsqueeze(1)
        scaled = torch.where(rows > 0, rows / rep, rows * rep)
        rows = torch.where(seen, scaled, rows)  # rows with a penalty of 1 are unchanged: x / 1 == x * 1 == x
    freq = torch.tensor([p.frequency_penalty for p in chosen], dtype=rows.dtype).unsqueeze(1)
    pres = torch.tensor([p.presence_penalty for p in chosen], dtype=rows.dtype).unsqueeze(1)
    rows = rows - freq * counts
    return rows - pres * seen_out.to(rows.dtype)
