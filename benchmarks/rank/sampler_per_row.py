"""The per-row sampler that ``worker_svc/sampling.py``'s vectorised one replaced, kept as ``benchmarks.rank.sampler``'s
baseline only (never served): every drawing or masked row alone through ``sample``, a fresh CPU generator per row
seeded from (seed, token index) and ``torch.multinomial``; the greedy rows in one ``argmax``."""

from __future__ import annotations

import math

import torch

from common.sample import Sample
from worker_svc import penalize
from worker_svc.sampling import RowSampling, SamplingError, draw_seed, is_greedy


def clean_logits(logits: torch.Tensor) -> torch.Tensor:
    """float32 logits without NaN or +inf: NaN -> -inf; if any +inf, those tokens 0 and every other -inf.
    Raises ``SamplingError`` when nothing is left to draw."""
    logits = logits.detach().float().reshape(-1)
    if logits.numel() == 0:
        raise SamplingError("the logits row is empty")
    if math.isfinite(float(logits.sum())):  # every entry is finite (NaN or inf would show in the sum); one fast
        return logits  # reduction where an elementwise isfinite() costs ~2x a log_softmax at 152k tokens
    logits = logits.masked_fill(torch.isnan(logits), -math.inf)
    pos_inf = torch.isposinf(logits)
    if bool(pos_inf.any()):
        return torch.full_like(logits, -math.inf).masked_fill(pos_inf, 0.0)
    if not bool(torch.isfinite(logits).any()):
        raise SamplingError(f"none of the {logits.numel()} logits is finite (NaN or -inf everywhere)")
    return logits


def _kth_largest(logits: torch.Tensor, k: int) -> torch.Tensor:
    # A partial selection of the smaller side, never a full sort: at 152k tokens the usual k (up to a few hundred)
    # costs under a millisecond on a CPU, k near the vocabulary as little, k = half the vocabulary ~8 ms; kthvalue
    # costs ~8 ms for every k.
    n = logits.numel()
    if k <= n - k + 1:
        return torch.topk(logits, k, sorted=False).values.min()
    return torch.topk(logits, n - k + 1, largest=False, sorted=False).values.max()  # the (n-k+1)-th smallest


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass strictly above each token
    keep = before < top_p
    keep[0] = True  # the most likely token always stays, however small top_p is
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)


def allow_only(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The grammar stage (structured output): a cleaned logits row with every token outside ``allowed`` (a boolean
    ``[vocab]`` row) at -inf. Raises ``SamplingError`` when no allowed token has a finite or +inf logit."""
    drawn = logits.masked_fill(~allowed, -math.inf)
    if not bool((drawn > -math.inf).any()):
        raise SamplingError(f"none of the {int(allowed.sum())} tokens the grammar allows has a finite logit")
    return drawn


def sample(
    logits: torch.Tensor,
    params: RowSampling,
    index: int,
    raw: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> Sample:
    """One token from a ``[vocab]`` logits row, already adjusted by its penalties; ``raw`` (default: ``logits``)
    is the model's row, whose distribution the log-probabilities describe. ``index`` is the output token index (0
    for the first). ``allowed``: the grammar's boolean row; the draw is among those tokens.
    Raises only ``SamplingError`` (logits without a finite entry)."""
    logits = clean_logits(logits)
    drawn = logits if allowed is None else allow_only(logits, allowed)
    temperature = float(params.temperature)
    if is_greedy(temperature):
        token = int(torch.argmax(drawn))
    else:
        # Shifted by the maximum first: the scaled values are <= 0 with an exact 0 at the maximum, so neither a
        # small temperature nor a huge logit range can overflow, and the softmax's sum is >= 1 before it normalizes.
        shifted = (drawn - drawn.max()) / temperature
        top_k = int(params.top_k)
        if 0 < top_k < logits.numel():
            shifted = shifted.masked_fill(drawn < _kth_largest(drawn, top_k), -math.inf)  # the maximum stays
        probs = torch.softmax(torch.nan_to_num(shifted, nan=-math.inf), dim=-1)
        top_p = float(params.top_p)
        if 0.0 < top_p < 1.0:
            probs = _nucleus(probs, top_p)
        generator = torch.Generator(device="cpu").manual_seed(draw_seed(int(params.seed), int(index)))
        token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    if not params.return_logprobs:
        return Sample(token, None, [])
    logprobs = torch.log_softmax(logits if raw is None else clean_logits(raw), dim=-1)
    top: list[tuple[int, float]] = []
    k = min(int(params.logprobs), logprobs.shape[-1])
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        top = [(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v != -math.inf]
    return Sample(token, float(logprobs[token]), top)


def sample_batch(
    logits: torch.Tensor,
    params: list[RowSampling],
    indices: list[int],
    histories: list[penalize.History | None] | None = None,
    allowed: dict[int, torch.Tensor] | None = None,
) -> list[Sample | SamplingError]:
    """``sample`` of every row of ``logits`` (``[n, vocab]``) with its own parameters and output index, one result
    per row: its ``Sample``, or the ``SamplingError`` that row alone raised. ``histories[i]``: row i's tokens
    ``(prompt + output so far, prompt length)``, needed where its penalties count them.

    Equal to calling ``sample`` row by row; what is common to the rows is done once: one finiteness check, one
    ``argmax`` for the greedy rows, one ``log_softmax`` and one ``topk`` for the rows that want log-probabilities.
    Rows that draw (a temperature) or hold a non-finite value go through ``sample`` alone: their generator is
    seeded per row, and their cleaning is per row. ``allowed``: row -> the grammar's boolean row (structured
    output); those rows go through ``sample`` too, with their mask."""
    allowed = allowed or {}
    n = logits.shape[0]
    raw = logits.detach().float()
    logits = penalize.apply(raw, [p.penalties for p in params], indices, histories or [None] * n)
    adjusted = logits is not raw
    finite = torch.isfinite(raw.sum(dim=-1)).tolist() if n else []  # one reduction; NaN/inf shows in the sum
    if adjusted and n:  # masks add -inf (fine for argmax); an overflow to +inf or nothing left goes the slow way
        finite = [f and m for f, m in zip(finite, torch.isfinite(logits.amax(dim=-1)).tolist(), strict=True)]
    out: list[Sample | SamplingError | None] = [None] * n
    greedy = [i for i in range(n) if finite[i] and is_greedy(float(params[i].temperature)) and i not in allowed]
    for i in range(n):
        if out[i] is None and i not in greedy:
            try:
                out[i] = sample(logits[i], params[i], indices[i], raw[i] if adjusted else None, allowed.get(i))
            except SamplingError as exc:
                out[i] = exc
    if greedy:
        rows = logits[greedy] if len(greedy) < n else logits
        tokens = torch.argmax(rows, dim=-1).tolist()
        wanting = [j for j, i in enumerate(greedy) if params[i].return_logprobs]
        lp_of: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        if wanting:
            raw_rows = raw[greedy] if len(greedy) < n else raw
            logprobs = torch.log_softmax(raw_rows[wanting], dim=-1)
            chosen = logprobs.gather(1, torch.tensor([[tokens[j]] for j in wanting])).flatten().tolist()
            for r, j in enumerate(wanting):
                top: list[tuple[int, float]] = []
                kj = min(int(params[greedy[j]].logprobs), logprobs.shape[-1])
                if kj > 0:  # per row with its own k: topk's order among tied values depends on k
                    values, ids = torch.topk(logprobs[r], kj)
                    top = [(t, v) for t, v in zip(ids.tolist(), values.tolist(), strict=True) if v != -math.inf]
                lp_of[j] = (chosen[r], top)
        for j, i in enumerate(greedy):
            if j in lp_of:
                out[i] = Sample(tokens[j], *lp_of[j])
            else:
                out[i] = Sample(tokens[j], None, [])
    return out  # type: ignore[return-value]
