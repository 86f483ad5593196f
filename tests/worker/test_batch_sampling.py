"""The vectorised sampler (``worker_svc/sampling.py``) over whole batches: each row's token depends on that row
alone, the cuts and masks hold in every row of a mixed batch, and the draws follow the distribution they claim
(many draws at fixed seeds: deterministic, so the tolerances cannot flake)."""

from __future__ import annotations

import math

import pytest
import torch

from common.penalties import Penalties
from worker_svc.sampling import (
    GREEDY_EPSILON,
    GrammarMasks,
    RowSampling,
    SamplingError,
    _inverse_cdf,
    draw_uniform,
    sample,
    sample_batch,
)
from worker_svc.token_mask import UnpackedMasks, allowed_rows, forbidden_rows, mask_nbytes

VOCAB = 40


def logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def mixed_batch(size: int, seed: int) -> tuple[torch.Tensor, list[RowSampling], list, dict[int, torch.Tensor]]:
    """Rows of every kind: greedy, temperature, top-k, top-p, both, penalised, grammar-masked, with log-probabilities,
    one with NaN and one with nothing finite."""
    x = logits(size, seed)
    kinds = [
        RowSampling(),
        RowSampling(temperature=1.0, seed=11),
        RowSampling(temperature=0.7, top_k=5, seed=12),
        RowSampling(temperature=1.3, top_p=0.8, seed=13, return_logprobs=True, logprobs=3),
        RowSampling(temperature=0.9, top_k=9, top_p=0.6, seed=14),
        RowSampling(temperature=1.0, seed=15, penalties=Penalties(frequency_penalty=1.0, logit_bias=((3, 4.0),))),
        RowSampling(temperature=1.0, seed=16, return_logprobs=True, logprobs=2),
        RowSampling(temperature=2.0, top_k=VOCAB - 2, seed=17),
    ]
    params = [kinds[i % len(kinds)] for i in range(size)]
    histories = [([1, 2, 3, 3, 4], 2)] * size
    allowed = {}
    for i in range(1, size, 5):
        row = torch.zeros(VOCAB, dtype=torch.bool)
        row[[i % VOCAB, (3 * i + 1) % VOCAB, (7 * i + 2) % VOCAB]] = True
        allowed[i] = row
    if size > 9:
        x[9, 4] = math.nan
        x[8] = -math.inf
    return x, params, histories, allowed


def test_every_row_draws_the_same_alone_as_in_a_batch_of_16():
    x, params, histories, allowed = mixed_batch(16, seed=3)
    for index in range(25):
        indices = [index] * 16
        batch = sample_batch(x, params, indices, histories, allowed)
        assert isinstance(batch[8], SamplingError), "a row with nothing finite fails alone"
        assert sum(isinstance(b, SamplingError) for b in batch) == 1
        for i in range(16):
            mask = {0: allowed[i]} if i in allowed else None
            alone = sample_batch(x[i : i + 1], [params[i]], [index], [histories[i]], mask)[0]
            if isinstance(alone, SamplingError):
                assert isinstance(batch[i], SamplingError) and str(batch[i]) == str(alone)
                continue
            assert (batch[i].token_id, batch[i].logprob, batch[i].top_logprobs) == (
                alone.token_id,
                alone.logprob,
                alone.top_logprobs,
            )


def test_a_seeded_row_ignores_what_else_the_batch_holds():
    row = logits(1, 9)[0]
    p = RowSampling(temperature=1.0, top_p=0.95, seed=2024)
    alone = [sample_batch(row.unsqueeze(0), [p], [i])[0].token_id for i in range(30)]
    for other_seed in (1, 2):
        x, params, histories, allowed = mixed_batch(16, other_seed)
        x[6], params[6] = row, p
        allowed.pop(6, None)
        histories = list(histories)
        histories[6] = None
        inside = [sample_batch(x, params, [i] * 16, histories, allowed)[6].token_id for i in range(30)]
        assert inside == alone
    assert len(set(alone)) > 3  # it does draw: the equality above is not that of a constant


def test_top_k_of_one_and_a_tiny_top_p_are_the_argmax_in_every_row():
    x = logits(16, 5)
    best = torch.argmax(x, dim=-1).tolist()
    for index in range(10):
        params = [
            RowSampling(temperature=t, seed=s, top_k=1) if s % 2 else RowSampling(temperature=t, seed=s, top_p=1e-7)
            for s, t in enumerate([0.5, 1.0, 3.0, 1e4] * 4)
        ]
        assert [s.token_id for s in sample_batch(x, params, [index] * 16)] == best


def test_masked_tokens_are_never_drawn():
    x = logits(8, 7)
    bits = []
    for r in range(8):
        b = bytearray(mask_nbytes(VOCAB))
        for t in (r, r + 10, r + 20):
            b[t // 8] |= 1 << (t % 8)
        bits.append(bytes(b))
    rows = allowed_rows(bits, VOCAB)
    allowed = {r: rows[r] for r in range(8)}
    params = [RowSampling(temperature=5.0, seed=r) for r in range(8)]
    seen: list[set[int]] = [set() for _ in range(8)]
    for index in range(300):
        for r, s in enumerate(sample_batch(x, params, [index] * 8, allowed=allowed)):
            seen[r].add(s.token_id)
    assert seen == [{r, r + 10, r + 20} for r in range(8)]  # only, and (at temperature 5) all, of the allowed


@pytest.mark.parametrize(
    "params",
    [
        RowSampling(temperature=1.0, seed=1),
        RowSampling(),  # greedy
        RowSampling(temperature=0.7, seed=1),
        RowSampling(temperature=1.0, top_p=0.9, seed=1),
        RowSampling(temperature=1.3, top_k=3, top_p=0.5, seed=1, return_logprobs=True, logprobs=2),
        RowSampling(temperature=float("inf"), seed=1),
    ],
    ids=["t1", "greedy", "t07", "top_p", "top_k_top_p_logprobs", "t_inf"],
)
def test_a_mask_that_leaves_no_finite_logit_fails_its_row_alone(params):
    """Found by the row's own draw (its softmax has no mass) or, greedy, by its maximum: never a token the grammar
    forbids, never a failure of the batch."""
    x = logits(3, 1)
    x[1, :5] = -math.inf
    only = torch.zeros(VOCAB, dtype=torch.bool)
    only[:5] = True
    got = sample_batch(x, [params] * 3, [0, 0, 0], allowed={1: only})
    assert isinstance(got[1], SamplingError) and "none of the 5 tokens the grammar allows" in str(got[1])
    assert not isinstance(got[0], SamplingError) and not isinstance(got[2], SamplingError)
    assert [s.token_id for s in (got[0], got[2])] == [s.token_id for s in sample_batch(x[[0, 2]], [params] * 2, [0, 0])]


def frequencies(row: torch.Tensor, params: RowSampling, draws: int) -> torch.Tensor:
    """How often each token is drawn over ``draws`` output indices, batched 100 rows a call."""
    counts = torch.zeros(row.numel())
    for start in range(0, draws, 100):
        got = sample_batch(row.expand(100, -1), [params] * 100, list(range(start, start + 100)))
        for s in got:
            counts[s.token_id] += 1
    return counts / draws


def test_draws_follow_the_softmax_and_its_cuts():
    row = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -math.inf])
    want = torch.softmax(row / 0.8, -1)
    got = frequencies(row, RowSampling(temperature=0.8, seed=4), 6000)
    assert float((got - want).abs().max()) < 0.025, (got, want)
    assert got[7] == 0
    cut = torch.softmax(row[:3] / 0.8, -1)  # top-k 3: renormalized over the three largest
    got = frequencies(row, RowSampling(temperature=0.8, seed=5, top_k=3), 6000)
    assert float((got[:3] - cut).abs().max()) < 0.025 and float(got[3:].sum()) == 0
    # top-p 0.6: the tokens with less than 0.6 of the mass strictly above them, renormalized
    probs = torch.softmax(row, -1)
    kept = int((torch.cumsum(probs, -1) - probs < 0.6).sum())
    got = frequencies(row, RowSampling(temperature=1.0, seed=6, top_p=0.6), 6000)
    nucleus = probs[:kept] / probs[:kept].sum()
    assert float((got[:kept] - nucleus).abs().max()) < 0.025 and float(got[kept:].sum()) == 0


def test_the_draw_never_lands_on_a_token_of_probability_zero():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]])
    for u in (0.0, 0.25, 0.5, 0.75, 1 - 2.0**-53):
        pos = _inverse_cdf(probs, [u, u])
        assert pos[0] in (1, 3) and pos[1] == 2, (u, pos)
    assert _inverse_cdf(probs, [0.0, 0.0]) == [1, 2]
    assert _inverse_cdf(probs, [1 - 2.0**-53] * 2) == [3, 2]
    assert _inverse_cdf(probs, [1.0, 1.0]) == [3, 2]  # a target at the total: the last token of non-zero mass


def test_uniforms_are_per_seed_and_index():
    values = [draw_uniform(seed, index) for seed in (0, 1, -1, 2**70 + 5) for index in range(50)]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)
    assert draw_uniform(7, 3) == draw_uniform(7, 3) == draw_uniform(7 + 2**64, 3)  # seeds modulo 2^64
    mean = sum(draw_uniform(123, i) for i in range(4000)) / 4000
    assert abs(mean - 0.5) < 0.02


def test_greedy_rows_beside_drawing_rows_keep_the_argmax_and_raw_logprobs():
    x = logits(6, 8)
    params = [
        RowSampling(return_logprobs=True, logprobs=2) if i % 2 else RowSampling(temperature=1.0) for i in range(6)
    ]
    params[0] = RowSampling(temperature=GREEDY_EPSILON / 2, return_logprobs=True)
    got = sample_batch(x, params, list(range(6)))
    lp = torch.log_softmax(x, -1)
    for i in (0, 1, 3, 5):
        assert got[i].token_id == int(torch.argmax(x[i]))
        assert got[i].logprob == float(lp[i, got[i].token_id])
    assert [t for t, _ in got[1].top_logprobs] == torch.topk(x[1], 2).indices.tolist()
    assert sample(x[3], params[3], 3) == got[3]


def test_temperatures_past_float32_draw_among_the_usable_tokens_only():
    x = torch.tensor([[math.nan, 0.0, -math.inf, 1.0]] * 3)
    params = [RowSampling(temperature=t, seed=s) for s, t in enumerate((3.4028235677973366e38, math.inf, 1e300))]
    for index in range(20):
        assert all(s.token_id in (1, 3) for s in sample_batch(x, params, [index] * 3))


def test_masks_and_cleaning_leave_the_callers_logits_as_they_were():
    x = logits(4, 2)
    x[2, 3] = math.nan
    before = x.clone()
    only = torch.zeros(VOCAB, dtype=torch.bool)
    only[[1, 2]] = True
    pen = RowSampling(temperature=1.0, penalties=Penalties(presence_penalty=1.0), return_logprobs=True)
    params = [RowSampling(return_logprobs=True), pen, RowSampling(temperature=1.0), RowSampling()]
    got = sample_batch(x, params, [0] * 4, [([1], 1)] * 4, {0: only, 1: only, 3: only})
    assert all(s.token_id in (1, 2) for s in (got[0], got[1], got[3]))
    assert got[0].logprob == float(torch.log_softmax(x[0], -1)[got[0].token_id])  # of the unmasked row
    row = x[0].clone()
    assert sample(row, params[0], 0, raw=x[1], allowed=only).token_id in (1, 2)
    assert torch.equal(row, x[0]) and torch.equal(x.nan_to_num(), before.nan_to_num())


def random_masks(count: int, vocab: int, seed: int) -> list[bytes]:
    g = torch.Generator().manual_seed(seed)
    return [
        bytes(torch.randint(0, 256, (mask_nbytes(vocab),), generator=g, dtype=torch.uint8).tolist())
        for _ in range(count)
    ]


@pytest.mark.parametrize("vocab", [40, 1000, 1021, 151936])
def test_forbidden_rows_are_the_complement_of_the_allowed_ones_bit_for_bit(vocab):
    masks = random_masks(3, vocab, vocab)
    forbidden = forbidden_rows(masks, vocab)
    assert forbidden.shape == (3, vocab) and forbidden.dtype == torch.bool
    assert torch.equal(forbidden, ~allowed_rows(masks, vocab))
    for r, mask in enumerate(masks):  # token t is bit t % 8 of byte t // 8
        for t in (0, 7, 8, 31, 32, vocab - 1):
            assert bool(forbidden[r, t]) == (not (mask[t // 8] >> (t % 8)) & 1), (r, t)


def test_unpacked_masks_unpack_a_repeated_mask_once_and_stay_within_their_bound():
    vocab = 1000
    a, b, c = random_masks(3, vocab, 5)
    row_bytes = vocab + mask_nbytes(vocab)
    cache = UnpackedMasks(max_bytes=2 * row_bytes)
    first = cache.forbidden([a], vocab)
    assert torch.equal(first, forbidden_rows([a], vocab))
    assert cache.forbidden([a], vocab) is first  # kept: not unpacked again
    both = cache.forbidden([b, a], vocab)
    assert torch.equal(both, forbidden_rows([b, a], vocab)) and len(cache) == 2 and cache.nbytes == 2 * row_bytes
    cache.forbidden([c], vocab)  # a third row: the least recently used (b: a was used after it) goes
    assert len(cache) == 2 and cache.nbytes <= cache.max_bytes
    assert cache.forbidden([a], vocab) is first
    assert torch.equal(cache.forbidden([b], vocab), forbidden_rows([b], vocab))
    small = UnpackedMasks(max_bytes=row_bytes - 1)  # a row larger than the bound is unpacked, never kept
    assert torch.equal(small.forbidden([a], vocab), forbidden_rows([a], vocab)) and len(small) == 0


def test_unpacked_grammar_masks_draw_as_the_allowed_rows_do():
    x, params, histories, allowed = mixed_batch(16, seed=9)  # masked rows 1, 6, 11: not consecutive
    rows = sorted(allowed)
    unpacked = GrammarMasks(rows, torch.stack([~allowed[i] for i in rows]))
    for index in range(10):
        by_dict = sample_batch(x, params, [index] * 16, histories, allowed)
        by_masks = sample_batch(x, params, [index] * 16, histories, unpacked)
        assert [repr(s) for s in by_dict] == [repr(s) for s in by_masks]
        for i in rows:
            if not isinstance(by_dict[i], SamplingError):
                assert bool(allowed[i][by_dict[i].token_id])
    one = GrammarMasks([1], unpacked.forbidden[:1])  # a single masked row: masked in place in the batch's copy
    before = x.clone()
    got = sample_batch(x, params, [3] * 16, histories, one)
    assert bool(allowed[1][got[1].token_id]) and torch.equal(x.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("vocab", [40, 1024, 151936])
def test_a_row_at_temperature_one_draws_the_same_beside_other_temperatures(vocab):
    """At temperature 1 the sampler hands the rows to the softmax unshifted: the same probabilities bit for bit as the
    shifted and scaled rows of a batch that also holds other temperatures, so a row draws the same either way."""
    x = logits(4, 8, vocab=vocab) * 10
    shifted = (x - x.amax(dim=-1, keepdim=True)) / torch.ones(4, 1)
    assert torch.equal(torch.softmax(x, dim=-1), torch.softmax(shifted, dim=-1))
    one = RowSampling(temperature=1.0, seed=21, return_logprobs=True, logprobs=2)
    for index in range(30):
        alone = sample_batch(x[:1], [one], [index])[0]
        beside = sample_batch(x[:2], [one, RowSampling(temperature=0.5, seed=2)], [index, index])[0]
        assert repr(alone) == repr(beside)


def test_writable_logits_take_the_masks_in_place_unless_log_probabilities_read_them():
    x = logits(3, 4)
    only = torch.zeros(VOCAB, dtype=torch.bool)
    only[[1, 2]] = True
    y = x.clone()
    got = sample_batch(y, [RowSampling(temperature=1.0, seed=3)] * 3, [0] * 3, allowed={1: only}, writable=True)
    assert got[1].token_id in (1, 2)
    assert torch.equal(y[[0, 2]], x[[0, 2]]) and torch.equal(y[1], x[1].masked_fill(~only, -math.inf))
    z = x.clone()  # a row wants log-probabilities: they come from these logits, which stay as they were
    params = [RowSampling(return_logprobs=True), RowSampling(temperature=1.0, seed=3), RowSampling()]
    got = sample_batch(z, params, [0] * 3, allowed={1: only}, writable=True)
    assert torch.equal(z, x) and got[1].token_id in (1, 2)
    assert got[0].logprob == float(torch.log_softmax(x[0], -1)[got[0].token_id])


def test_a_rank_step_masks_the_forward_s_own_logits_in_one_batched_call(caplog):
    """The rank's step hands its forward's logits (inference tensors) to the sampler to write its masks into: in
    inference mode, in one batched call. Outside it the write raised, and every step fell back to sampling each
    request alone, silently and ~0.1 ms slower (now the fallback logs)."""
    from types import SimpleNamespace

    from mmcast.v1 import worker_pb2
    from worker_svc.runner import StepLogits
    from worker_svc.step_sampling import sample_step

    with torch.inference_mode():
        batch = logits(2, 6) + 0  # made in inference mode, as the runner's forward makes them
    before = batch.clone()
    states = [
        SimpleNamespace(request_id=rid, sampling=RowSampling(temperature=t, seed=4), num_output_tokens=0,
                        token_ids=[1, 2], num_prompt_tokens=2)
        for rid, t in (("free", 0.0), ("constrained", 1.0))
    ]  # fmt: skip
    bits = bytearray(mask_nbytes(VOCAB))
    bits[0] = 0b0000_0110  # tokens 1 and 2
    masks = {"constrained": worker_pb2.TokenMask(request_id="constrained", allowed=bytes(bits))}
    with caplog.at_level("WARNING"):
        got = sample_step(states, StepLogits(batch, [0, 1]), masks, 0, UnpackedMasks())
    assert not caplog.records
    assert got[0].token_id == int(before[0].argmax()) and got[1].token_id in (1, 2)
    assert torch.equal(batch[0], before[0]) and int(torch.isfinite(batch[1]).sum()) == 2  # masked in place


def test_rows_of_a_large_vocabulary_draw_the_same_alone_as_in_a_batch():
    """Qwen2-VL's 151,936 tokens: the kernels' vectorised paths over long rows, batch or not."""
    x = logits(6, 4, vocab=151936)
    params = [
        RowSampling(temperature=1.0, seed=1, return_logprobs=True, logprobs=5),
        RowSampling(temperature=0.6, top_p=0.9, seed=2),
        RowSampling(temperature=1.2, top_k=50, seed=3),
        RowSampling(),
        RowSampling(temperature=0.8, top_k=100_000, top_p=0.95, seed=5),
        RowSampling(temperature=1.0, seed=6, penalties=Penalties(repetition_penalty=1.2)),
    ]
    histories = [([5, 9, 9], 1)] * 6
    for index in (0, 7):
        batch = sample_batch(x, params, [index] * 6, histories)
        for i in range(6):
            alone = sample_batch(x[i : i + 1], [params[i]], [index], [histories[i]])[0]
            assert (batch[i].token_id, batch[i].logprob, batch[i].top_logprobs) == (
                alone.token_id,
                alone.logprob,
                alone.top_logprobs,
            )


def test_a_nucleus_found_among_the_candidates_draws_as_a_full_sort_would(monkeypatch):
    from worker_svc import sampling as sampling_mod

    x = logits(4, 6, vocab=4096) / 3 - 12  # a tail of small mass, and 30 likely tokens per row: a nucleus of
    x[:, 100:3100:100] = logits(4, 8, vocab=30) / 3  # a few of them, inside the 256 candidates
    x[3] = logits(1, 7, vocab=4096)[0] / 10  # nearly flat: its nucleus reaches past them
    params = [RowSampling(temperature=1.0, top_p=p, seed=9) for p in (0.9, 0.5, 0.99, 0.9)]
    fast = [[s.token_id for s in sample_batch(x, params, [i] * 4)] for i in range(40)]
    monkeypatch.setattr(sampling_mod, "_NUCLEUS_CANDIDATES", 4096)  # every row sorted whole
    assert fast == [[s.token_id for s in sample_batch(x, params, [i] * 4)] for i in range(40)]
    assert len({row[0] for row in fast}) > 1 and len({row[3] for row in fast}) > 10
