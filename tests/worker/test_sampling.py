"""The rank's sampler (``worker_svc/sampling.py``): exact rules for the extremes, and hypothesis fuzzing of every
sampling parameter (top-k included) and of non-finite logits — never an exception for parameters, a token inside the vocabulary,
no NaN log-probability.

Budgets: the ``quick`` properties run in ``make test``; the ``fuzz``-marked ones with ``make fuzz`` at a hundred
times the examples (the same property)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from worker_svc.sampling import GREEDY_EPSILON, RowSampling, SamplingError, draw_seed, sample, sample_batch

VOCAB = 64
SCALE = 100  # make fuzz: this many times the examples of make test


def logits_row(seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 4


def test_temperatures_below_the_epsilon_are_greedy():
    row = logits_row()
    best = int(torch.argmax(row))
    for t in (0.0, -0.0, 1e-45, 1e-40, 1e-38, 1e-30, GREEDY_EPSILON / 2, math.nan, -1.0, -math.inf):
        for seed in (0, 1, 2**64 - 1):
            got = sample(row, RowSampling(temperature=t, seed=seed, return_logprobs=True), 3)
            assert got.token_id == best, t
            assert got.logprob == pytest.approx(float(torch.log_softmax(row, -1)[best]))


def test_small_temperature_above_the_epsilon_still_samples_and_is_reproducible():
    # Two near-equal top logits: at 1e-5 a gap of 1e-6 still leaves both probable, so draws differ across seeds.
    row = torch.full((VOCAB,), -10.0)
    row[5], row[9] = 3.0, 3.0 - 1e-6
    draws = {sample(row, RowSampling(temperature=GREEDY_EPSILON, seed=s), 0).token_id for s in range(40)}
    assert draws == {5, 9}
    again = [sample(row, RowSampling(temperature=GREEDY_EPSILON, seed=s), 0).token_id for s in range(40)]
    assert again == [sample(row, RowSampling(temperature=GREEDY_EPSILON, seed=s), 0).token_id for s in range(40)]


def test_tiny_top_p_keeps_only_the_most_likely_token():
    row = logits_row(1)
    best = int(torch.argmax(row))
    for top_p in (1e-45, 1e-38, 1e-7, float(torch.softmax(row, -1).max()) * 0.999):
        tokens = {sample(row, RowSampling(temperature=1.0, top_p=top_p, seed=s), 0).token_id for s in range(30)}
        assert tokens == {best}, top_p


def test_top_p_outside_the_open_interval_is_no_cut():
    row = torch.zeros(VOCAB)  # uniform: without a cut every token is possible
    for top_p in (0.0, -0.0, -1.0, math.nan, 1.0, 5.0, math.inf):
        tokens = {sample(row, RowSampling(temperature=1.0, top_p=top_p, seed=s), 0).token_id for s in range(400)}
        assert len(tokens) > VOCAB // 2, top_p


def test_top_p_just_below_one_cuts_only_the_tail():
    row = torch.zeros(VOCAB)
    row[0] = -40.0  # probability ~e^-40 / 63: in the last 1e-7 of the mass
    tokens = {sample(row, RowSampling(temperature=1.0, top_p=1 - 1e-7, seed=s), 0).token_id for s in range(300)}
    assert 0 not in tokens and len(tokens) > VOCAB // 2


def test_non_finite_logits():
    row = logits_row(2)
    row[7] = math.nan
    row[11] = -math.inf
    best = int(torch.argmax(torch.nan_to_num(row, nan=-math.inf)))
    got = sample(row, RowSampling(return_logprobs=True, logprobs=VOCAB), 0)
    assert got.token_id == best and math.isfinite(got.logprob)
    assert {t for t, _ in got.top_logprobs} == set(range(VOCAB)) - {7, 11}  # zero-probability tokens are left out
    assert all(math.isfinite(v) for _, v in got.top_logprobs)
    # +inf: those tokens share all the probability
    row[20] = row[30] = math.inf
    for t in (0.0, 1.0, 2.0):
        draws = [sample(row, RowSampling(temperature=t, seed=s, return_logprobs=True), 0) for s in range(30)]
        assert {d.token_id for d in draws} <= {20, 30}
        assert all(d.logprob == pytest.approx(math.log(0.5)) for d in draws)
    with pytest.raises(SamplingError, match="none of the 64 logits is finite"):
        sample(torch.full((VOCAB,), math.nan), RowSampling(), 0)
    with pytest.raises(SamplingError):
        sample(torch.full((VOCAB,), -math.inf), RowSampling(temperature=1.0), 0)


def test_huge_logit_ranges_do_not_overflow():
    row = torch.tensor([3e38, -3e38, 3e38 - 1e33, 0.0])
    for t in (GREEDY_EPSILON, 0.5, 2.0, 1e30):
        got = sample(row, RowSampling(temperature=t, return_logprobs=True, logprobs=4), 0)
        assert got.token_id in (0, 2, 3) and not math.isnan(got.logprob)
        assert all(not math.isnan(v) for _, v in got.top_logprobs)


def test_logprobs_limits():
    row = logits_row(3)
    assert sample(row, RowSampling(return_logprobs=True, logprobs=-5), 0).top_logprobs == []
    assert sample(row, RowSampling(return_logprobs=True, logprobs=0), 0).top_logprobs == []
    top = sample(row, RowSampling(return_logprobs=True, logprobs=2**40), 0).top_logprobs
    assert [t for t, _ in top] == torch.argsort(row, descending=True).tolist()
    assert sample(row, RowSampling(return_logprobs=False, logprobs=20), 0).logprob is None


def test_seeds_of_any_size_draw_reproducibly():
    row = torch.zeros(VOCAB)
    for seed in (0, 1, -1, -(2**70), 2**63, 2**64 - 1, 2**64, 2**200):
        s = draw_seed(seed, 0)
        assert 0 <= s < 2**63
        a = sample(row, RowSampling(temperature=1.0, seed=seed), 5).token_id
        assert a == sample(row, RowSampling(temperature=1.0, seed=seed), 5).token_id


# --- top-k -------------------------------------------------------------------------------------------------------


def test_top_k_of_one_is_greedy_at_any_temperature():
    for row_seed in range(6):
        row = logits_row(row_seed)
        best = int(torch.argmax(row))
        for t in (GREEDY_EPSILON, 0.5, 1.0, 2.0, 1e4):
            tokens = {sample(row, RowSampling(temperature=t, seed=s, top_k=1), 0).token_id for s in range(25)}
            assert tokens == {best}, (row_seed, t)


def test_top_k_draws_only_and_all_of_the_k_largest():
    row = logits_row(4) / 8  # nearly flat at temperature 2: every kept token is drawn often in 400 draws
    order = torch.argsort(row, descending=True).tolist()
    for k in (2, 5, 17, VOCAB - 1):
        tokens = {sample(row, RowSampling(temperature=2.0, seed=s, top_k=k), 0).token_id for s in range(400)}
        assert tokens == set(order[:k]), k  # a subset alone would pass a cut stronger than k


def test_top_k_draws_repeat_per_seed_and_index():
    row = logits_row(5)
    params = [RowSampling(temperature=1.5, seed=s, top_k=8) for s in range(30)]
    first = [sample(row, p, 3).token_id for p in params]
    assert first == [sample(row, p, 3).token_id for p in params]
    assert first != [sample(row, p, 4).token_id for p in params]  # the index is part of the seed
    assert len(set(first)) > 1


def test_top_k_outside_the_vocabulary_is_no_cut():
    row = logits_row(6)
    for k in (0, -1, -(2**40), VOCAB, VOCAB + 1, 2**40):
        for s in range(60):  # the very draws of no cut, not merely as many distinct tokens
            plain = sample(row, RowSampling(temperature=1.0, seed=s), 2).token_id
            assert sample(row, RowSampling(temperature=1.0, seed=s, top_k=k), 2).token_id == plain, k


def test_tokens_tied_with_the_kth_logit_all_stay():
    row = torch.full((VOCAB,), -5.0)
    row[[3, 8, 13]] = 2.0  # three tokens share the largest logit
    row[20] = 1.9
    tokens = {sample(row, RowSampling(temperature=1.0, seed=s, top_k=1), 0).token_id for s in range(200)}
    assert tokens == {3, 8, 13}
    tokens = {sample(row, RowSampling(temperature=1.0, seed=s, top_k=4), 0).token_id for s in range(300)}
    assert tokens == {3, 8, 13, 20}


def test_top_p_applies_after_top_k_to_the_renormalized_distribution():
    # p = (0.40, 0.31, 0.28, 0.01). top_p 0.5 alone keeps {0, 1} (0.40 of mass lies above token 1). After top_k=2
    # the two left weigh (0.563, 0.437), and 0.563 >= 0.5 lies above token 1: only token 0 stays. The other order
    # (top_p first) would keep {0, 1}.
    row = torch.log(torch.tensor([0.40, 0.31, 0.28, 0.01]))

    def drawn(**kwargs):
        return {sample(row, RowSampling(temperature=1.0, seed=s, **kwargs), 0).token_id for s in range(300)}

    assert drawn(top_p=0.5) == {0, 1}
    assert drawn(top_k=2, top_p=0.5) == {0}
    assert drawn(top_k=3, top_p=0.5) == {0, 1}  # renormalized over three: 0.404 above token 1
    assert drawn(top_k=2, top_p=0.6) == {0, 1}
    assert drawn(top_k=2) == {0, 1}


def test_top_k_leaves_the_log_probabilities_of_the_unmodified_distribution():
    row = logits_row(7)
    full = torch.log_softmax(row, -1)
    for s in range(20):
        got = sample(row, RowSampling(temperature=1.0, seed=s, return_logprobs=True, logprobs=VOCAB, top_k=3), 0)
        assert got.logprob == pytest.approx(float(full[got.token_id]))
        assert [t for t, _ in got.top_logprobs] == torch.argsort(
            row, descending=True
        ).tolist()  # tokens the cut removed too


def test_greedy_ignores_top_k():
    row = logits_row(8)
    for k in (0, 1, 2, VOCAB):
        assert sample(row, RowSampling(temperature=0.0, top_k=k), 0).token_id == int(torch.argmax(row))


def test_the_rank_refuses_a_top_k_above_its_vocabulary():
    from mmcast.v1 import worker_pb2
    from worker_svc.request_state import sampling_from_proto
    from worker_svc.step_errors import StepError, code

    assert sampling_from_proto(worker_pb2.WorkerSampling(), "r", vocab_size=VOCAB).top_k == 0
    assert sampling_from_proto(worker_pb2.WorkerSampling(top_k=VOCAB), "r", vocab_size=VOCAB).top_k == VOCAB
    for k in (VOCAB + 1, 2**32 - 1):
        with pytest.raises(StepError) as info:
            sampling_from_proto(worker_pb2.WorkerSampling(top_k=k), "r7", vocab_size=VOCAB)
        assert info.value.code == code.OUT_OF_RANGE and info.value.request_id == "r7"
        assert info.value.message == f"new_requests[r7].sampling.top_k={k} exceeds the vocabulary of {VOCAB} tokens"


# --- fuzzing -----------------------------------------------------------------------------------------------------

special_floats = st.sampled_from(
    [
        0.0,
        -0.0,
        1e-45,
        -1e-45,
        1e-40,
        1e-38,
        1e-30,
        1e-7,
        GREEDY_EPSILON,
        1 - 1e-7,
        1.0,
        1 + 1e-7,
        2.0,
        1e4,
        3e38,
        math.inf,
        -math.inf,
        math.nan,
    ]
)
any_float = st.one_of(special_floats, st.floats(allow_nan=True, allow_infinity=True, width=32), st.floats())
seeds = st.one_of(st.integers(0, 2**64 - 1), st.integers(-(2**80), 2**80), st.sampled_from([0, 2**63, 2**64 - 1]))
logprob_counts = st.one_of(st.integers(-3, VOCAB + 3), st.integers(-(2**40), 2**40), st.just(20))
top_ks = st.one_of(st.integers(-3, VOCAB + 3), st.integers(-(2**40), 2**40), st.sampled_from([0, 1]))
logit_values = st.one_of(
    st.floats(-30, 30, width=32),
    st.sampled_from([math.nan, math.inf, -math.inf, 3e38, -3e38, 1e-45]),
)


@st.composite
def rows(draw) -> torch.Tensor:
    vocab = draw(st.integers(1, VOCAB))
    base = draw(st.lists(st.floats(-30, 30, width=32), min_size=vocab, max_size=vocab))
    row = torch.tensor(base, dtype=torch.float32)
    for index, value in draw(st.lists(st.tuples(st.integers(0, vocab - 1), logit_values), max_size=vocab)):
        row[index] = value
    return row.to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])))


def check_sample(row: torch.Tensor, params: RowSampling, index: int) -> None:
    usable = torch.isfinite(row.float()) | torch.isposinf(row.float())
    if not bool(usable.any()):
        with pytest.raises(SamplingError):
            sample(row, params, index)
        return
    got = sample(row, params, index)
    assert 0 <= got.token_id < row.numel()
    assert bool(usable[got.token_id]), "drew a NaN or -inf logit"
    if params.return_logprobs:
        assert got.logprob is not None and math.isfinite(got.logprob) and got.logprob <= 1e-6
        assert len(got.top_logprobs) <= max(0, min(params.logprobs, row.numel()))
        assert all(0 <= t < row.numel() and not math.isnan(v) and v <= 1e-6 for t, v in got.top_logprobs)
    else:
        assert got.logprob is None and got.top_logprobs == []
    if params.top_k > 0:  # fewer than k tokens lie strictly above the drawn one (ties with the k-th stay)
        values = row.float().nan_to_num(nan=-math.inf)
        assert int((values > values[got.token_id]).sum()) < params.top_k, "drew outside the top k"


def run(prop, examples: int, long: bool) -> None:
    settings(
        max_examples=examples * (SCALE if long else 1),
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )(prop)()


def fuzz_parameters(long: bool) -> None:
    @given(
        temperature=any_float,
        top_p=any_float,
        seed=seeds,
        logprobs=logprob_counts,
        return_logprobs=st.booleans(),
        index=st.one_of(st.integers(0, 4096), st.integers(-(2**70), 2**70)),
        top_k=top_ks,
    )
    def prop(temperature, top_p, seed, logprobs, return_logprobs, index, top_k):
        params = RowSampling(temperature, top_p, seed, logprobs, return_logprobs, top_k)
        check_sample(logits_row(abs(seed) % 7), params, index)

    run(prop, 150, long)


def fuzz_logits(long: bool) -> None:
    @given(row=rows(), temperature=any_float, top_p=any_float, seed=seeds, logprobs=logprob_counts, top_k=top_ks)
    def prop(row, temperature, top_p, seed, logprobs, top_k):
        check_sample(row, RowSampling(temperature, top_p, seed, logprobs, True, top_k), 0)

    run(prop, 150, long)


def test_fuzz_sampling_parameters_quick():
    fuzz_parameters(long=False)


def test_fuzz_logits_quick():
    fuzz_logits(long=False)


@pytest.mark.fuzz
def test_fuzz_sampling_parameters():
    fuzz_parameters(long=True)


@pytest.mark.fuzz
def test_fuzz_logits():
    fuzz_logits(long=True)


def check_batch(rows: list[torch.Tensor], params: list[RowSampling], indices: list[int]) -> None:
    """``sample_batch`` equals ``sample`` row by row: the same token, log-probabilities and alternatives, or the same
    failure for that row alone."""
    got = sample_batch(torch.stack(rows), params, indices)
    assert len(got) == len(rows)
    for row, p, index, g in zip(rows, params, indices, got, strict=True):
        try:
            want = sample(row, p, index)
        except SamplingError:
            assert isinstance(g, SamplingError)
            continue
        assert isinstance(g, type(want)) and g.token_id == want.token_id and g.top_logprobs == want.top_logprobs
        assert g.logprob == want.logprob


def test_a_batch_samples_each_row_as_alone():
    rows = [logits_row(i) for i in range(6)]
    rows[2] = rows[2].clone()
    rows[2][5] = math.nan  # a non-finite row beside finite ones
    rows[3] = torch.full((VOCAB,), -math.inf)  # no token at all: that row's failure only
    rows[4] = rows[1].clone()  # ties across rows are irrelevant; within a row the first maximum wins
    params = [
        RowSampling(),
        RowSampling(return_logprobs=True, logprobs=3),
        RowSampling(return_logprobs=True, logprobs=0),
        RowSampling(return_logprobs=True, logprobs=2),
        RowSampling(temperature=0.8, top_p=0.9, seed=7, return_logprobs=True, logprobs=5),
        RowSampling(return_logprobs=True, logprobs=VOCAB + 10),
    ]
    check_batch(rows, params, [0, 3, 1, 2, 9, 4])
    got = sample_batch(torch.stack(rows), params, [0, 3, 1, 2, 9, 4])
    assert isinstance(got[3], SamplingError) and all(isinstance(g, type(got[0])) for i, g in enumerate(got) if i != 3)
    assert sample_batch(torch.empty(0, VOCAB), [], []) == []


@given(
    batch=st.lists(
        st.tuples(
            st.integers(0, 30),
            st.lists(st.tuples(st.integers(0, VOCAB - 1), logit_values), max_size=3),
            st.sampled_from([0.0, 1e-6, 0.7, math.nan]),
            logprob_counts,
            st.booleans(),
            top_ks,
        ),
        min_size=1,
        max_size=8,
    )
)
@example(  # tied log-probabilities: topk's order among ties depends on k, so each row takes its own k
    batch=[
        (16, [], 1e-06, 20, True, 56),
        (30, [], math.nan, 20, True, 0),
        (3, [], 0.0, 6, True, 30),
        (7, [(6, 3e38)], 0.0, 2, True, 51),
    ]  # fmt: skip
)
@settings(max_examples=60, deadline=None, database=None)
def test_fuzz_a_batch_samples_each_row_as_alone(batch):
    rows, params = [], []
    for seed, edits, temperature, logprobs, return_logprobs, top_k in batch:
        row = logits_row(seed)
        for index, value in edits:
            row[index] = value
        rows.append(row)
        params.append(RowSampling(temperature, 0.9, seed, logprobs, return_logprobs, top_k))
    check_batch(rows, params, list(range(len(rows))))


@given(
    temperature=st.floats(0, 2, width=32),
    top_p=st.floats(0, 1, width=32, exclude_min=True),
    top_k=st.integers(0, VOCAB),
)
@settings(max_examples=100, deadline=None, database=None)
def test_every_parameter_the_api_admits_samples(temperature, top_p, top_k):
    """Exactly the ranges ``scheduler_svc/doors/request_parsing.py parse_sampling`` admits, through the rank's proto parsing."""
    from mmcast.v1 import worker_pb2
    from worker_svc.request_state import sampling_from_proto

    msg = worker_pb2.WorkerSampling(
        temperature=temperature, top_p=top_p, seed=2**64 - 1, logprobs=20, return_logprobs=True, top_k=top_k
    )
    check_sample(logits_row(), sampling_from_proto(msg, "r", vocab_size=VOCAB), 0)
