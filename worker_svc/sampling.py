"""Token sampling on rank 0, vectorised over the step's batch: greedy, or temperature + top-k + top-p, each row
reproducible per (request seed, token index) whatever else the step holds.

The draw for output token ``i`` of a request is an inverse-CDF draw with one uniform number derived from
``(seed, i)`` alone (``draw_uniform``: a 64-bit mix, no generator state), so a request recomputed after preemption
or recovery repeats exactly the draws it made before, and its tokens do not depend on the rows beside it.
Log-probabilities are those of the unmodified model distribution (``log_softmax`` of the raw logits: vLLM's
``raw_logprobs`` mode), whatever the penalties, logit biases, min_tokens masking, grammar, temperature, top-k and
top-p did to the draw.

``sample_batch`` applies the step's penalties and biases to the whole batch (worker_svc/penalize.py), then samples
every row in a few tensor operations: one cleaning of the rows holding NaN or inf, the grammar masks of the masked
rows in one ``masked_fill``, one ``argmax`` for the greedy rows; for the drawing rows one scaling by their
temperatures, one top-k threshold selection, one ``softmax``, one ``sort`` for the rows with a top-p cut and one
cumulative sum and ``searchsorted`` for the draw; one ``log_softmax`` and one ``topk`` per distinct count for the
log-probabilities. ``sample`` is one row through the same code (its logits already adjusted).

``sample`` is total over its parameters: whatever the temperature, top-k, top-p, seed or logprobs count (NaN,
infinities, -0.0, denormals, negative or huge values) it returns a token inside the vocabulary and log-probabilities
that are never NaN. The rules, in order:

- temperature below ``GREEDY_EPSILON`` (or NaN) is greedy. Dividing logits by a denormal temperature overflows
  to inf and the softmax to NaN; and at 1e-5 a logit gap of 1e-3 already weighs e^-100 (~4e-44, below float32's
  smallest positive value), so every temperature under the threshold draws the argmax except between near-ties.
  vLLM uses the same threshold. Greedy ignores top-k and top-p (the argmax survives both);
- top-k <= 0 (the proto's unset 0 included) or >= the vocabulary is no cut; otherwise the tokens whose logit is
  strictly below the k-th largest are removed before the softmax. Every token tied with the k-th largest logit
  stays, so more than k may remain: which of equal logits to drop would otherwise depend on the sort, and vLLM's
  threshold keeps them too. The threshold is taken on the cleaned logits, not the temperature-scaled ones:
  scaling is monotone, so the same tokens pass, but a scaled value could round into a tie the logits lack;
- top-p is applied after top-k (vLLM's order), to the distribution renormalized over the tokens top-k kept;
  tokens are ranked by probability (among equal ones in an order fixed by the row alone);
- top-p outside (0, 1) (0, -0.0, negative, NaN, >= 1) is no nucleus cut (an unset proto float is 0); any positive
  top-p keeps at least the most likely token, so 1e-45 is greedy among the finite logits;
- the draw: the kept probabilities' cumulative sum (float64; in token-id order, or in the nucleus's order for a
  top-p row) is searched for the uniform number times the total; a token of probability zero is never drawn;
- a logprobs count <= 0 returns no alternatives; above the vocabulary, the whole vocabulary; alternatives of
  probability zero are left out;
- logits: NaN never wins (it is treated as -inf); tokens at +inf share all the probability; -inf is never drawn.
  Logits with no finite or +inf entry at all carry no distribution: ``SamplingError``, the request's own failure.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import torch

from common.penalties import NONE, Penalties
from common.sample import Sample
from worker_svc import penalize

_MASK64 = (1 << 64) - 1
_MASK63 = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads consecutive indices over the seed space
GREEDY_EPSILON = 1e-5  # temperatures below this are greedy (see the module docstring)
_NEG_INF = -math.inf
_F32_MAX = torch.finfo(torch.float32).max
_NUCLEUS_CANDIDATES = 256  # a top-p row's nucleus is looked for among its most likely tokens first


class SamplingError(ValueError):
    """The logits of one request admit no token (none is finite); that request fails, the rank does not."""


@dataclasses.dataclass(frozen=True)
class RowSampling:
    """What the sampler needs for one row of a step's batch (one request), from the wire's ``WorkerSampling``."""

    temperature: float = 0.0  # < GREEDY_EPSILON = greedy
    top_p: float = 1.0  # (0, 1); anything else = no nucleus cut
    seed: int = 0  # with the output token index, seeds the draw (any integer; reduced modulo 2^64)
    logprobs: int = 0  # top alternatives to return besides the sampled token (<= 0: none)
    return_logprobs: bool = False  # False: no log-probabilities at all
    top_k: int = 0  # (0, vocab): draw among the k largest logits and their ties; else no cut
    penalties: Penalties = NONE  # applied to the logits before everything above (sample_batch)


def draw_seed(seed: int, index: int) -> int:
    """The 63-bit draw key of output token ``index`` of a request seeded ``seed``."""
    mixed = (seed * _GOLDEN + (index + 1) * (_GOLDEN >> 1)) & _MASK64
    mixed ^= mixed >> 29
    return mixed & _MASK63


def draw_uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) (53 bits) that output token ``index`` of a request seeded ``seed`` is drawn
    with: ``draw_seed`` through splitmix64's finalizer, so neighbouring keys give unrelated numbers."""
    z = draw_seed(seed, index)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    z ^= z >> 31
    return (z >> 11) * 2.0**-53


def is_greedy(temperature: float) -> bool:
    return not temperature >= GREEDY_EPSILON  # NaN included


def _clean(rows: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """Rows without NaN or +inf (NaN -> -inf; a row with any +inf: those tokens 0, every other -inf), and for each
    whether anything is left to draw."""
    rows = rows.masked_fill(torch.isnan(rows), _NEG_INF)
    pos_inf = torch.isposinf(rows)
    rows = torch.where(pos_inf.any(dim=-1, keepdim=True), torch.where(pos_inf, 0.0, _NEG_INF), rows)
    return rows, (rows > _NEG_INF).any(dim=-1).tolist()


def _cleaned(logits: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``logits`` (or a cleaned copy) with every row's NaN and +inf resolved, and the rows left with nothing to
    draw. One reduction finds the rows to clean: NaN or inf shows in a row's sum."""
    bad = [i for i, total in enumerate(logits.sum(dim=-1).tolist()) if not math.isfinite(total)]
    if not bad:
        return logits, []
    out = logits.clone()
    out[bad], usable = _clean(logits[bad])
    return out, [i for i, ok in zip(bad, usable, strict=True) if not ok]


def _consecutive(rows: list[int]) -> bool:
    return rows[-1] - rows[0] + 1 == len(rows)


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t``'s rows (ascending, distinct): a view when they are consecutive, else one ``index_select``."""
    if _consecutive(rows):
        return t[rows[0] : rows[-1] + 1]
    return t.index_select(0, torch.tensor(rows))


@dataclasses.dataclass(frozen=True)
class GrammarMasks:
    """The grammar masks of a batch (structured output): ``forbidden[j]`` is batch row ``rows[j]``'s, True where
    the row's grammar forbids the token (``worker_svc/token_mask.py``'s ``forbidden_rows`` unpacks the wire's)."""

    rows: list[int]  # ascending, distinct
    forbidden: torch.Tensor  # [len(rows), vocab] bool

    @classmethod
    def allowing(cls, allowed: dict[int, torch.Tensor]) -> GrammarMasks:
        """From row -> the boolean row of the tokens it may draw."""
        rows = sorted(allowed)
        return cls(rows, ~torch.stack([allowed[i].reshape(-1) for i in rows]))

    def row(self, j: int) -> GrammarMasks:
        """Mask ``j`` alone, as the mask of row 0 of a one-row batch."""
        return GrammarMasks([0], self.forbidden[j : j + 1])


def _masked(logits: torch.Tensor, owned: bool, masks: GrammarMasks) -> torch.Tensor:
    """The grammar stage (structured output): each masked row's forbidden tokens at -inf, all the masked rows in
    one ``masked_fill_`` (in ``logits`` itself when ``owned``, else in a copy). A row left with nothing to draw is
    found by its draw (``_sample_rows``), not by a reduction here."""
    rows = masks.rows
    out = logits if owned else logits.clone()
    sub = _take(out, rows)
    sub.masked_fill_(masks.forbidden, _NEG_INF)
    if not _consecutive(rows):  # ``sub`` is a copy: written back in one call
        out.index_copy_(0, torch.tensor(rows), sub)
    return out


def _no_allowed_token(masks: GrammarMasks, row: int) -> SamplingError:
    n = int((~masks.forbidden[masks.rows.index(row)]).sum())
    return SamplingError(f"none of the {n} tokens the grammar allows has a finite logit")


def _kth_largest(rows: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """The k-th largest value of each row (``ks[r]`` for row r, 0 < k < vocab), as a ``[rows, 1]`` column. A
    partial selection of the smaller side when every row allows one (at 152k tokens the usual k, up to a few
    hundred, costs under a millisecond a row); a full sort of the rows otherwise."""
    vocab, kmax = rows.shape[-1], max(ks)
    smallest = [vocab - k + 1 for k in ks]  # the k-th largest is the (vocab-k+1)-th smallest
    if kmax <= vocab // 2:
        values, at = torch.topk(rows, kmax, dim=-1, sorted=True).values, [k - 1 for k in ks]
    elif max(smallest) <= vocab // 2:
        values, at = (
            torch.topk(rows, max(smallest), dim=-1, largest=False, sorted=True).values,
            [s - 1 for s in smallest],
        )
    else:
        values, at = torch.sort(rows, dim=-1, descending=True).values, [k - 1 for k in ks]
    return values.gather(1, torch.tensor(at, dtype=torch.long).unsqueeze(1))


def _inverse_cdf(probs: torch.Tensor, uniforms: list[float]) -> list[int]:
    """Per row, the first position whose cumulative probability exceeds the row's uniform number times the row's
    total: position i is drawn with probability ``probs[i] / total``; a position of probability zero never. A row
    without mass (NaN: the softmax of a row a grammar mask left without a finite logit) gets -1."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    totals = cdf[:, -1].tolist()
    target = torch.tensor([[u * t] for u, t in zip(uniforms, totals, strict=True)], dtype=torch.float64)
    pos = torch.searchsorted(cdf, target, right=True).flatten().tolist()
    vocab = probs.shape[-1]
    for r, p in enumerate(pos):
        if not totals[r] > 0:
            pos[r] = -1
        elif p >= vocab:  # the product rounded up to the total: the last position of non-zero probability
            pos[r] = int(torch.nonzero(probs[r] > 0).max())
    return pos


def _ranked_draw(ranked: torch.Tensor, order: torch.Tensor, keep: torch.Tensor, uniforms: list[float]) -> list[int]:
    """The token ids drawn from rows of probabilities in ranked order (``order``: their ids), ``keep`` the nucleus;
    -1 for a row without mass (``_inverse_cdf``)."""
    got = _inverse_cdf(ranked * keep, uniforms)
    ids = order.gather(1, torch.tensor([max(p, 0) for p in got]).unsqueeze(1)).flatten().tolist()
    return [t if p >= 0 else -1 for t, p in zip(ids, got, strict=True)]


def _kept(ranked: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """The nucleus of rows of probabilities in descending order: the tokens with less than ``top_p`` of the mass
    strictly above them, and always the first."""
    before = torch.cumsum(ranked, dim=-1) - ranked
    keep = before < torch.tensor(top_p, dtype=ranked.dtype).unsqueeze(1)
    keep[:, 0] = True  # the most likely token always stays, however small top_p is
    return keep


def _nucleus(probs: torch.Tensor, top_p: list[float], uniforms: list[float]) -> list[int]:
    """One token per row of ``probs`` from its top-p nucleus. The nucleus is looked for among the row's
    ``_NUCLEUS_CANDIDATES`` most likely tokens first (one ``topk``; a 152k-token sort costs ~10 ms a row here); only
    rows whose nucleus reaches past them are sorted whole. A token tied with the last candidate but left out has at
    least as much mass above it, so it is outside the nucleus either way."""
    vocab, tokens = probs.shape[-1], [0] * len(top_p)
    rest = list(range(len(top_p)))
    if vocab > 2 * _NUCLEUS_CANDIDATES:
        ranked, order = torch.topk(probs, _NUCLEUS_CANDIDATES, dim=-1, sorted=True)
        keep = _kept(ranked, top_p)
        inside = [r for r, past in enumerate(keep[:, -1].tolist()) if not past]
        if inside:
            got = _ranked_draw(
                _take(ranked, inside), _take(order, inside), _take(keep, inside), [uniforms[r] for r in inside]
            )
            for r, t in zip(inside, got, strict=True):
                tokens[r] = t
        rest = [r for r, past in enumerate(keep[:, -1].tolist()) if past]
    if rest:
        ranked, order = torch.sort(_take(probs, rest), dim=-1, descending=True, stable=True)
        keep = _kept(ranked, [top_p[r] for r in rest])
        for r, t in zip(rest, _ranked_draw(ranked, order, keep, [uniforms[r] for r in rest]), strict=True):
            tokens[r] = t
    return tokens


def _draw(drawn: torch.Tensor, params: list[RowSampling], uniforms: list[float]) -> list[int]:
    """One token per row of ``drawn`` (cleaned, masked logits) at its own temperature, top-k and top-p, with its own
    uniform number; -1 for a row a grammar mask left without a finite logit."""
    vocab = drawn.shape[-1]
    if all(float(p.temperature) == 1.0 for p in params):
        # The softmax subtracts each row's maximum itself: the same float32 differences, bit for bit, as the shifted
        # rows below divided by 1. Four tensor operations fewer at the API's default temperature.
        shifted = drawn
    else:
        temperature = torch.tensor([float(p.temperature) for p in params], dtype=torch.float32).unsqueeze(1)
        # Shifted by each row's maximum first: the scaled values are <= 0 with an exact 0 at the maximum, so neither
        # a small temperature nor a huge logit range can overflow, and the softmax's sum is >= 1 before it normalizes.
        shifted = (drawn - drawn.amax(dim=-1, keepdim=True)) / temperature
    cut = [r for r, p in enumerate(params) if 0 < int(p.top_k) < vocab]
    if cut:
        threshold = torch.full((len(params), 1), _NEG_INF)
        threshold[cut] = _kth_largest(drawn[cut], [int(params[r].top_k) for r in cut])
        shifted = shifted.masked_fill(drawn < threshold, _NEG_INF)  # each row's maximum stays
    if any(float(p.temperature) > _F32_MAX for p in params):  # inf in float32: -inf / inf is NaN (cut or masked)
        shifted = torch.nan_to_num(shifted, nan=_NEG_INF)
    probs = torch.softmax(shifted, dim=-1)
    nucleus = [r for r, p in enumerate(params) if 0.0 < float(p.top_p) < 1.0]
    plain = [r for r in range(len(params)) if r not in set(nucleus)]
    tokens = [0] * len(params)
    if plain:
        rows = probs if len(plain) == len(params) else probs[plain]
        for r, t in zip(plain, _inverse_cdf(rows, [uniforms[r] for r in plain]), strict=True):
            tokens[r] = t
    if nucleus:
        drawn_at = _nucleus(
            _take(probs, nucleus), [float(params[r].top_p) for r in nucleus], [uniforms[r] for r in nucleus]
        )
        for r, t in zip(nucleus, drawn_at, strict=True):
            tokens[r] = t
    return tokens


def _logprobs(
    source: torch.Tensor, rows: list[int], tokens: dict[int, int], counts: list[int]
) -> dict[int, tuple[float, list[tuple[int, float]]]]:
    """Each row's (log-probability of its token, its top alternatives): one ``log_softmax`` over the rows, one
    ``gather``, and one ``topk`` per distinct count (topk's order among tied values depends on k, so a row's
    alternatives never depend on another row's count)."""
    logprobs = torch.log_softmax(_take(source, rows), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in rows])).flatten().tolist()
    top: dict[int, list[tuple[int, float]]] = {i: [] for i in rows}
    by_count: dict[int, list[int]] = defaultdict(list)
    for r, k in enumerate(counts):
        if k > 0:
            by_count[min(k, logprobs.shape[-1])].append(r)
    for k, group in by_count.items():
        values, ids = torch.topk(logprobs[group], k, dim=-1)
        for r, vs, ts in zip(group, values.tolist(), ids.tolist(), strict=True):
            top[rows[r]] = [(t, v) for t, v in zip(ts, vs, strict=True) if v != _NEG_INF]
    return {i: (c, top[i]) for i, c in zip(rows, chosen, strict=True)}


def _sample_rows(
    logits: torch.Tensor,
    params: list[RowSampling],
    indices: list[int],
    raw: torch.Tensor | None,
    masks: GrammarMasks | None,
    own: bool = False,
) -> list[Sample | SamplingError]:
    """Every row of ``logits`` (``[n, vocab]`` float32, already adjusted by its penalties) sampled with its own
    parameters; ``raw`` (default: ``logits``) are the rows the log-probabilities describe. ``own``: ``logits`` is
    this call's to write (the penalties' copy, or a caller's that nothing reads after)."""
    n, vocab = logits.shape
    if vocab == 0:
        return [SamplingError("the logits row is empty") for _ in range(n)]
    errors: dict[int, SamplingError] = {}
    cleaned, empty = _cleaned(logits)
    for i in empty:
        errors[i] = SamplingError(f"none of the {vocab} logits is finite (NaN or -inf everywhere)")
    # The masks write into the cleaned logits where those are this call's (``own``, or the cleaning's copy) and not
    # the source of any log-probabilities (the raw rows are, when given), else into a copy.
    if masks is not None:
        read_after = raw is None and any(p.return_logprobs for p in params)
        drawn = _masked(cleaned, (own or cleaned is not logits) and not read_after, masks)
    else:
        drawn = cleaned
    live = [i for i in range(n) if i not in errors]
    greedy = [i for i in live if is_greedy(float(params[i].temperature))]
    drawing = [i for i in live if not is_greedy(float(params[i].temperature))]
    tokens: dict[int, int] = {}
    if greedy:
        tokens.update(zip(greedy, torch.argmax(_take(drawn, greedy), dim=-1).tolist(), strict=True))
        masked_greedy = sorted(set(greedy).intersection(masks.rows)) if masks is not None else []
        if masked_greedy:  # an argmax of a row without a finite logit is a token the grammar forbids
            for i, top in zip(masked_greedy, _take(drawn, masked_greedy).amax(dim=-1).tolist(), strict=True):
                if top == _NEG_INF:
                    errors[i] = _no_allowed_token(masks, i)
    if drawing:
        uniforms = [draw_uniform(int(params[i].seed), int(indices[i])) for i in drawing]
        chosen = _draw(_take(drawn, drawing), [params[i] for i in drawing], uniforms)
        for i, token in zip(drawing, chosen, strict=True):
            if token >= 0:
                tokens[i] = token
            else:  # no mass: only a grammar mask leaves a row so (the cleaning failed every other such row)
                errors[i] = _no_allowed_token(masks, i)
    live = [i for i in live if i not in errors]
    wanting = [i for i in live if params[i].return_logprobs]
    source = cleaned
    if wanting and raw is not None:
        source, empty = _cleaned(raw)
        for i in empty:
            if i in tokens and params[i].return_logprobs:
                errors[i] = SamplingError(f"none of the {vocab} raw logits is finite (NaN or -inf everywhere)")
        wanting = [i for i in wanting if i not in errors]
    scored = _logprobs(source, wanting, tokens, [int(params[i].logprobs) for i in wanting]) if wanting else {}
    out: list[Sample | SamplingError] = []
    for i in range(n):
        if i in errors:
            out.append(errors[i])
        elif i in scored:
            out.append(Sample(tokens[i], *scored[i]))
        else:
            out.append(Sample(tokens[i], None, []))
    return out


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
    Raises only ``SamplingError`` (logits without a finite entry). The same code as a row of ``sample_batch``."""
    row = logits.detach().float().reshape(1, -1)
    raw_row = None if raw is None else raw.detach().float().reshape(1, -1)
    masks = None if allowed is None else GrammarMasks([0], ~allowed.reshape(1, -1))
    got = _sample_rows(row, [params], [index], raw_row, masks)[0]
    if isinstance(got, SamplingError):
        raise got
    return got


def sample_batch(
    logits: torch.Tensor,
    params: list[RowSampling],
    indices: list[int],
    histories: list[penalize.History | None] | None = None,
    allowed: GrammarMasks | dict[int, torch.Tensor] | None = None,
    writable: bool = False,
) -> list[Sample | SamplingError]:
    """``sample`` of every row of ``logits`` (``[n, vocab]``) with its own parameters and output index, one result
    per row: its ``Sample``, or the ``SamplingError`` that row alone raised. ``histories[i]``: row i's tokens
    ``(prompt + output so far, prompt length)``, needed where its penalties count them. ``allowed``: row -> the
    grammar's boolean row (structured output). A row's result depends on that row alone (its logits, parameters,
    output index and history), never on the other rows of the batch. ``allowed`` may also be the masks unpacked
    for the sampler (``GrammarMasks``, as the rank's step does). ``writable``: nothing reads ``logits`` after this
    call, so the grammar masks may be written into them where no log-probabilities are taken from them (saves a
    copy of the batch); otherwise the caller's logits are left as they were."""
    n = logits.shape[0]
    if n == 0:
        return []
    raw = logits.detach().float()
    adjusted = penalize.apply(raw, [p.penalties for p in params], indices, histories or [None] * n)
    penalized = adjusted is not raw
    masks = GrammarMasks.allowing(allowed) if isinstance(allowed, dict) and allowed else allowed or None
    return _sample_rows(adjusted, params, indices, raw if penalized else None, masks, penalized or writable)
