"""The batched penalties (worker_svc/penalize.py, through sample_batch) against the plain definitions written here
one token at a time: vLLM's repetition penalty over prompt + output, OpenAI's presence and frequency penalties over
the output, logit_bias added, min_tokens masking the ending tokens. Fuzzed batches mix rows with and without
penalties, greedy and drawn, with and without log-probabilities."""

from __future__ import annotations

import math
import random

import pytest
import torch

from common import penalties as penalties_mod
from common.errors import InvalidArgument
from common.penalties import Penalties
from mmcast.v1 import generation_pb2, worker_pb2
from worker_svc import penalize
from worker_svc.sampling import RowSampling, SamplingError, sample, sample_batch

VOCAB = 50


def reference(row: list[float], p: Penalties, prompt: list[int], output: list[int]) -> list[float]:
    """The definitions, token by token in Python floats (vLLM's order)."""
    row = list(row)
    if len(output) < p.min_tokens:
        for t in p.masked_until_min:
            row[t] = -math.inf
    for t, bias in p.logit_bias:
        row[t] += bias
    for t in range(len(row)):
        count = output.count(t)
        if t in prompt or count:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        row[t] -= p.frequency_penalty * count
        row[t] -= p.presence_penalty * (count > 0)
    return row


def random_penalties(rng: random.Random) -> Penalties:
    if rng.random() < 0.3:
        return Penalties()  # a row without penalties
    pick = rng.random
    return Penalties(
        presence_penalty=rng.uniform(-2, 2) if pick() < 0.6 else 0.0,
        frequency_penalty=rng.uniform(-2, 2) if pick() < 0.6 else 0.0,
        repetition_penalty=rng.choice([1.0, rng.uniform(0.1, 3.0), 1000.0]) if pick() < 0.7 else 1.0,
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in sorted(rng.sample(range(VOCAB), rng.randint(0, 5)))),
        min_tokens=rng.randint(0, 6),
        masked_until_min=tuple(sorted(rng.sample(range(VOCAB), rng.randint(0, 3)))),
    )


def random_batch(rng: random.Random, n: int):
    logits = torch.randn(n, VOCAB) * 5
    pens = [random_penalties(rng) for _ in range(n)]
    histories, indices = [], []
    for _ in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
        histories.append((prompt + output, len(prompt)))
        indices.append(len(output))
    return logits, pens, indices, histories


@pytest.mark.parametrize("seed", range(40))
def test_batched_penalties_equal_the_reference(seed):
    rng = random.Random(seed)
    logits, pens, indices, histories = random_batch(rng, rng.randint(1, 9))
    got = penalize.apply(logits, pens, indices, histories)
    for i, p in enumerate(pens):
        tokens, n_prompt = histories[i]
        want = torch.tensor(reference(logits[i].tolist(), p, tokens[:n_prompt], tokens[n_prompt:]))
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), i
        torch.testing.assert_close(got[i].nan_to_num(neginf=0.0), want.float().nan_to_num(neginf=0.0))
        if not p.active:
            assert torch.equal(got[i], logits[i]), "a row without penalties must be untouched"
    assert not torch.equal(got, logits) or not any(p.active for p in pens)


def test_no_penalties_returns_the_same_tensor():
    logits = torch.randn(3, VOCAB)
    assert penalize.apply(logits, [Penalties()] * 3, [0, 1, 2], [None] * 3) is logits


@pytest.mark.parametrize("seed", range(20))
def test_sample_batch_draws_from_the_adjusted_logits_and_reports_raw_logprobs(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(1, 8)
    logits, pens, indices, histories = random_batch(rng, n)
    params = [
        RowSampling(
            temperature=rng.choice([0.0, 0.0, 0.8]),
            seed=rng.randrange(2**32),
            return_logprobs=rng.random() < 0.7,
            logprobs=rng.randint(0, 3),
            penalties=p,
        )
        for p in pens
    ]
    got = sample_batch(logits, params, indices, histories)
    for i in range(n):
        tokens, n_prompt = histories[i]
        adjusted = torch.tensor(reference(logits[i].tolist(), pens[i], tokens[:n_prompt], tokens[n_prompt:]))
        want = sample(adjusted.float(), params[i], indices[i], raw=logits[i])  # the reference row, sampled alone
        if params[i].temperature == 0.0:
            assert got[i].token_id == int(torch.argmax(adjusted))
        assert got[i].token_id == want.token_id
        if params[i].return_logprobs:  # of the raw model distribution (vLLM's raw_logprobs)
            raw_lp = torch.log_softmax(logits[i], -1)
            assert got[i].logprob == pytest.approx(float(raw_lp[got[i].token_id]), abs=1e-5)
            assert [t for t, _ in got[i].top_logprobs] == [t for t, _ in want.top_logprobs]


def test_bias_plus_100_makes_greedy_pick_the_token_and_min_tokens_masks_the_end():
    logits = torch.randn(2, VOCAB)
    p = [
        RowSampling(penalties=Penalties(logit_bias=((7, 100.0),))),
        RowSampling(penalties=Penalties(logit_bias=((3, 100.0),), min_tokens=2, masked_until_min=(3,))),
    ]
    histories = [([1, 2], 2), ([1, 2, 5], 2)]
    got = sample_batch(logits, p, [0, 1], histories)
    assert got[0].token_id == 7
    assert got[1].token_id != 3  # one token out, min_tokens 2: the ending token is masked
    assert sample_batch(logits[1:], p[1:], [2], [([1, 2, 5, 6], 2)])[0].token_id == 3


def test_a_resumed_request_counts_its_regenerated_tokens_as_output():
    """After preemption the rank receives prompt + generated tokens with num_output_tokens = len(generated): the
    history (token_ids, num_prompt) is then the same as the uninterrupted request's, and so are the logits."""
    logits = torch.randn(1, VOCAB)
    p = Penalties(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    prompt, output = [1, 2, 3], [4, 4, 9]
    running = penalize.apply(logits, [p], [3], [(prompt + output, 3)])
    resumed = penalize.apply(logits, [p], [3], [(list(prompt + output), len(prompt + output) - len(output))])
    wrong = penalize.apply(logits, [p], [3], [(prompt + output, 6)])  # outputs taken as prompt: differs
    assert torch.equal(running, resumed)
    assert not torch.equal(running, wrong)


def test_everything_masked_fails_the_row_alone():
    logits = torch.full((2, 4), -math.inf)
    logits[:, 2] = 1.0
    p = [RowSampling(penalties=Penalties(min_tokens=1, masked_until_min=(2,))), RowSampling()]
    got = sample_batch(logits, p, [0, 0], [([0], 1), ([0], 1)])
    assert isinstance(got[0], SamplingError) and got[1].token_id == 2


def _proto(**kw) -> generation_pb2.SamplingParams:
    return generation_pb2.SamplingParams(max_tokens=8, **kw)


@pytest.mark.parametrize(
    ("kwargs", "field", "words"),
    [
        ({"presence_penalty": 2.5}, "sampling.presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3.0}, "sampling.frequency_penalty", "[-2, 2]"),
        ({"frequency_penalty": math.nan}, "sampling.frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0.0}, "sampling.repetition_penalty", "(0, 1000]"),
        ({"repetition_penalty": -1.0}, "sampling.repetition_penalty", "(0, 1000]"),
        ({"logit_bias": {VOCAB: 1.0}}, f"sampling.logit_bias[{VOCAB}]", f"[0, {VOCAB})"),
        ({"logit_bias": {-1: 1.0}}, "sampling.logit_bias[-1]", "outside the vocabulary"),
        ({"logit_bias": {3: 101.0}}, "sampling.logit_bias[3]", "[-100, 100]"),
        ({"logit_bias": {i: 1.0 for i in range(1025)}}, "sampling.logit_bias", "limit is 1024"),
        ({"min_tokens": 9}, "sampling.min_tokens", "<= max_tokens"),
    ],
)
def test_parse_refuses_each_out_of_range_value_naming_the_field(kwargs, field, words):
    with pytest.raises(InvalidArgument) as err:
        penalties_mod.parse(_proto(**kwargs), vocab_size=VOCAB if "1025" not in str(kwargs) else 2000, max_tokens=8)
    assert err.value.fields[0] == field  # min_tokens names max_tokens second
    assert words in err.value.message and field in err.value.message


def test_parse_and_the_worker_proto_round_trip():
    p = penalties_mod.parse(
        _proto(presence_penalty=0.5, repetition_penalty=1.25, logit_bias={9: -5.0, 2: 3.0, 4: 0.0}, min_tokens=3),
        vocab_size=VOCAB,
        max_tokens=8,
    )
    assert p.logit_bias == ((2, 3.0), (9, -5.0)) and p.min_tokens == 3  # zero biases dropped, ids sorted
    p = p.with_ending_tokens({7, 1})
    msg = worker_pb2.WorkerSampling()
    penalties_mod.to_worker(p, msg)
    assert penalties_mod.from_worker(msg, vocab_size=VOCAB) == p
    msg.logit_bias_token_ids.append(VOCAB)
    msg.logit_bias_values.append(1.0)
    with pytest.raises(ValueError, match="logit_bias_token_ids"):
        penalties_mod.from_worker(msg, vocab_size=VOCAB)
    assert penalties_mod.parse(_proto(), vocab_size=VOCAB, max_tokens=8) == Penalties()


def _bad_reference(row: list[float], words, output: list[int]) -> list[float]:
    row = list(row)
    for word in words:
        head = list(word[:-1])
        if len(head) <= len(output) and (not head or output[len(output) - len(head) :] == head):
            row[word[-1]] = -math.inf
    return row


@pytest.mark.parametrize("seed", range(20))
def test_bad_words_mask_the_last_token_after_the_rest(seed):
    rng = random.Random(500 + seed)
    n = rng.randint(1, 6)
    logits = torch.randn(n, VOCAB)
    pens, histories, indices, words_of = [], [], [], []
    for _ in range(n):
        output = [rng.randrange(4) for _ in range(rng.randint(0, 6))]  # a small alphabet: suffixes match often
        words = tuple(tuple(rng.randrange(4) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 4)))
        pens.append(Penalties(bad_word_ids=words))
        words_of.append(words)
        histories.append(([9, 9] + output, 2))
        indices.append(len(output))
    got = penalize.apply(logits, pens, indices, histories)
    for i in range(n):
        want = torch.tensor(_bad_reference(logits[i].tolist(), words_of[i], histories[i][0][2:]))
        assert torch.equal(got[i], want.float()), i


def test_bad_word_tokenization_follows_the_leading_space_rule():
    vocab = {"fox": [5], " fox": [6], "big dog": [1, 2], " big dog": [7, 2], "cat": [3], " cat": [3, 4]}
    encode = vocab.__getitem__
    got = penalties_mod.bad_word_sequences(["fox", " big dog", "cat"], encode)
    # " fox" is another single token: kept; " cat" has another length: dropped (the word alone covers it)
    assert got == ((5,), (6,), (1, 2), (7, 2), (3,))
