"""A step's penalties and biases (common/penalties.py) applied to its ``[batch, vocab]`` logits at once, on rank 0.

The work is proportional to the tokens involved, not to batch x vocabulary: every penalized row's output tokens
become one flat list of (row, token) pairs, counted once by ``torch.unique``; the repetition penalty reads and writes
the distinct (row, token) pairs of prompt and output with one gather and one ``index_put_``; the frequency and
presence penalties and the logit biases are each one accumulating ``index_put_`` over their pairs, and the masks one
``index_put_`` of -inf. The per-request Python work is only the gathering of its token ids (and, for bad words, a
loop over its words). Rows without penalties are not touched; the logits are not copied when no row has any.

Order (vLLM's): min_tokens and bad_words masking, logit_bias, repetition_penalty, frequency_penalty,
presence_penalty. The counts are over the request's output tokens so far: ``token_ids[num_prompt:]`` of the rank's
state, which after a preemption or recovery still holds the regenerated prefix as output (request_state.py takes
``num_prompt`` from ``NewRequest.num_output_tokens``), so a recomputed request is penalized exactly as before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from common.penalties import Penalties

History = tuple[Sequence[int], int]  # (prompt + output token ids so far, prompt length): the output follows it


def _pairs(rows: list[int], ids: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) index tensors on ``device`` of every id of ``ids[r]`` in row ``rows[r]``."""
    flat = [t for group in ids for t in group]
    index = [r for r, group in zip(rows, ids, strict=True) for _ in group]
    return torch.tensor(index, dtype=torch.long, device=device), torch.tensor(flat, dtype=torch.long, device=device)


def apply(
    logits: torch.Tensor, penalties: list[Penalties], indices: list[int], histories: Sequence[History | None]
) -> torch.Tensor:
    """``logits`` (``[n, vocab]`` float32) with each row's penalties applied; a new tensor when any row has
    penalties, else ``logits`` itself. ``indices[i]``: row i's output index (how many tokens it has out);
    ``histories[i]``: its tokens, needed for rows whose penalties count them (else may be None)."""
    active = [i for i, p in enumerate(penalties) if p.active]
    if not active:
        return logits
    out = logits.clone()  # the raw logits stay as they are: the log-probabilities describe them
    masked = [(i, penalties[i].masked_until_min) for i in active if indices[i] < penalties[i].min_tokens]
    masked += [(i, banned) for i in active if (banned := _banned(penalties[i], histories[i]))]
    if masked:
        where = _pairs([i for i, _ in masked], [list(m) for _, m in masked], out.device)
        out.index_put_(where, torch.tensor(-math.inf, device=out.device))
    biased = [i for i in active if penalties[i].logit_bias]
    if biased:
        rows, ids = _pairs(biased, [[t for t, _ in penalties[i].logit_bias] for i in biased], out.device)
        values = [v for i in biased for _, v in penalties[i].logit_bias]
        values = torch.tensor(values, dtype=out.dtype, device=out.device)
        out.index_put_((rows, ids), values, accumulate=True)
    counting = [i for i in active if penalties[i].counts_output]
    if counting:
        _penalize(out, counting, penalties, histories)
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


def _penalize(out: torch.Tensor, rows: list[int], penalties: list[Penalties], histories) -> None:
    """Repetition, then frequency and presence penalties, in place on ``out``'s ``rows``."""
    vocab, device = out.shape[1], out.device
    per_row = torch.zeros((out.shape[0], 3), dtype=out.dtype, device=device)  # repetition, frequency, presence
    per_row[:, 0] = 1.0
    per_row[rows] = torch.tensor(
        [
            [penalties[i].repetition_penalty, penalties[i].frequency_penalty, penalties[i].presence_penalty]
            for i in rows
        ],
        dtype=out.dtype,
        device=device,
    )
    r, t = _pairs(rows, [list(histories[i][0][histories[i][1] :]) for i in rows], device)
    keys, counts = torch.unique(r * vocab + t, return_counts=True)  # each (row, output token) once, with its count
    repeating = [i for i in rows if penalties[i].repetition_penalty != 1.0]
    if repeating:
        pr, pt = _pairs(repeating, [list(histories[i][0][: histories[i][1]]) for i in repeating], device)
        seen = torch.unique(torch.cat([pr * vocab + pt, keys]))  # prompt or output; rows with a penalty of 1 keep
        sr, st = seen // vocab, seen % vocab  # their logits: x / 1 == x * 1 == x
        values, rep = out[sr, st], per_row[sr, 0]
        out[sr, st] = torch.where(values > 0, values / rep, values * rep)
    kr, kt = keys // vocab, keys % vocab
    out.index_put_((kr, kt), -(per_row[kr, 1] * counts.to(out.dtype)), accumulate=True)
    out.index_put_((kr, kt), -per_row[kr, 2], accumulate=True)
