"""Penalties, logit_bias, min_tokens and n > 1 through the real ``openai`` package against the shared ``serve-local``
TP=2 group. The penalized reference is plain transformers (the checkpoint loaded with ``from_pretrained``, the prompt
tokenized by its own tokenizer) with the public definitions applied to its logits at each step, written out here:
vLLM's repetition penalty over prompt + output, OpenAI's presence and frequency penalties over the output."""

from __future__ import annotations

import concurrent.futures
import json

import openai
import pytest

from tests.support.oracle import LOGPROB_TOLERANCE

pytestmark = pytest.mark.slow

N = 8
PROMPT = "The quick brown fox jumps over the lazy dog and then"
REPEATING = "a a a a a a a a"  # the tiny model's greedy answer repeats itself here, so penalties change it


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def penalized_greedy(hf, prompt: str, n: int, *, presence=0.0, frequency=0.0, repetition=1.0, banned=()):
    """Greedy tokens of the whole model run without a cache, each step's logits penalized by the definitions, and
    the raw log-probabilities of the chosen tokens."""
    import torch

    model, tokenizer = hf
    prompt_ids = tokenizer(prompt)["input_ids"]
    out: list[int] = []
    logprobs: list[float] = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(input_ids=torch.tensor([prompt_ids + out])).logits[0, -1].float()
            adjusted = logits.clone()
            for t in set(prompt_ids) | set(out):
                v = float(adjusted[t])
                adjusted[t] = v / repetition if v > 0 else v * repetition
            for t in set(out):
                adjusted[t] -= frequency * out.count(t) + presence
            for t in banned:  # one-token bad words: never drawn
                adjusted[t] = -float("inf")
            token = int(torch.argmax(adjusted))
            out.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
    return out, logprobs


def complete(api, model_name, **kw):
    kw = {"prompt": PROMPT, "max_tokens": N, "temperature": 0.0, "logprobs": 0, "extra_body": {}, **kw}
    return api.completions.create(model=model_name, **kw)


@pytest.mark.parametrize(
    "penalties",
    [dict(repetition=1.3), dict(presence=2.0, frequency=1.5), dict(repetition=0.5, frequency=-2.0)],
    ids=["repetition", "presence+frequency", "reward-repeats"],
)
def test_penalized_greedy_equals_transformers_with_the_definitions(api, model_name, hf, penalties):
    plain_tokens, _ = penalized_greedy(hf, REPEATING, N)
    tokens, logprobs = penalized_greedy(hf, REPEATING, N, **penalties)
    assert tokens != plain_tokens, "the penalty must change the greedy output for the test to mean anything"
    body = {"ignore_eos": True}
    if "repetition" in penalties:
        body["repetition_penalty"] = penalties["repetition"]
    got = complete(
        api,
        model_name,
        prompt=REPEATING,
        presence_penalty=penalties.get("presence", 0.0),
        frequency_penalty=penalties.get("frequency", 0.0),
        extra_body=body,
    ).choices[0]
    assert got.text == hf[1].decode(tokens).removesuffix("\ufffd")  # a cut multi-byte character is held back
    served = got.logprobs.token_logprobs  # the raw model distribution's, as documented
    assert max(abs(a - b) for a, b in zip(served, logprobs, strict=True)) < LOGPROB_TOLERANCE


def test_bad_words_are_never_generated_and_the_rest_is_transformers_greedy(api, model_name, hf):
    """vLLM's rule for a word: tokenized alone, and with a leading space where that gives as many tokens (another
    token); a one-token form is masked at every step, so the answer is the model's greedy one without it."""
    tokenizer = hf[1]
    plain, _ = penalized_greedy(hf, PROMPT, N)
    word = tokenizer.decode([plain[0]]).strip()
    alone, spaced = (tokenizer(w, add_special_tokens=False)["input_ids"] for w in (word, " " + word))
    assert len(alone) == 1, alone
    banned = {alone[0]} | ({spaced[0]} if len(spaced) == 1 else set())
    tokens, _ = penalized_greedy(hf, PROMPT, N, banned=banned)
    assert tokens != plain and not banned & set(tokens)
    got = complete(api, model_name, extra_body={"ignore_eos": True, "bad_words": [word]}).choices[0]
    assert got.text == tokenizer.decode(tokens).removesuffix("\ufffd")  # a cut multi-byte character is held back


def test_logit_bias_plus_100_makes_greedy_pick_that_token(api, model_name, hf):
    token = hf[1](" fox")["input_ids"][-1]
    got = complete(api, model_name, logit_bias={str(token): 100}, extra_body={"ignore_eos": True}).choices[0]
    assert got.text == hf[1].decode([token] * N).removesuffix("\ufffd")
    minus = complete(api, model_name, logit_bias={str(token): -100}, extra_body={"ignore_eos": True}).choices[0]
    assert hf[1].decode([token]) not in minus.text


def test_min_tokens_holds_back_a_strongly_biased_end_of_sequence(api, model_name, hf, tiny_model_dir):
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(tiny_model_dir).eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    bias = {str(eos): 100}
    early = complete(api, model_name, logit_bias=bias, max_tokens=20)
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    got = complete(api, model_name, logit_bias=bias, max_tokens=20, extra_body={"min_tokens": 5})
    assert got.choices[0].finish_reason == "stop"
    # five tokens, then the end-of-sequence token (counted, as a single request counts it)
    assert got.usage.completion_tokens == 6 and len(got.choices[0].logprobs.tokens) == 6


def test_n_choices_share_one_prefill_and_are_reproducible(api, model_name):
    prompt = PROMPT + " a long prompt so that several blocks of sixteen tokens are full " * 3
    kw = dict(model=model_name, prompt=prompt, max_tokens=6, temperature=1.0, seed=1234, n=3)
    kw["extra_body"] = {"ignore_eos": True}
    first = api.completions.create(**kw)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert first.usage.prompt_tokens_details.cached_tokens > 0  # the followers read the leader's blocks
    single = api.completions.create(**{**kw, "n": 1, "seed": 1234})
    assert first.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once, as OpenAI counts
    assert first.usage.completion_tokens == 3 * 6
    again = api.completions.create(**kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    # choice i is the single request seeded seed + i (vLLM's rule)
    second_alone = api.completions.create(**{**kw, "n": 1, "seed": 1235}).choices[0].text
    assert second_alone == texts[1]

    stream = api.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=6,
        temperature=1.0,
        seed=7,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: dict[int, str] = {0: "", 1: ""}
    finished, usage = set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            parts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    whole = api.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": prompt}], max_tokens=6, temperature=1.0, seed=7, n=2
    )
    assert finished == {0, 1} and usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert [parts[0], parts[1]] == [c.message.content for c in sorted(whole.choices, key=lambda c: c.index)]


def test_n_choices_of_each_prompt_of_a_list(api, model_name):
    """/v1/completions with two prompts and n=2: OpenAI's indexing (prompt * n + j), choice j of a prompt equal to
    that prompt sent alone with n=2, each prompt's tokens counted once; the stream carries the same texts."""
    prompts = [PROMPT + " first", PROMPT + " and the second prompt"]
    kw = dict(model=model_name, max_tokens=4, temperature=1.0, seed=99, n=2, extra_body={"ignore_eos": True})
    both = api.completions.create(prompt=prompts, **kw)
    by_index = {c.index: c.text for c in both.choices}
    assert sorted(by_index) == [0, 1, 2, 3]
    alone = [api.completions.create(prompt=p, **kw) for p in prompts]
    for p, single in enumerate(alone):
        for c in single.choices:
            assert by_index[p * 2 + c.index] == c.text, (p, c.index)
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 4 * 4
    parts: dict[int, str] = {}
    for chunk in api.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + c.text
    assert parts == by_index


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        (dict(presence_penalty=2.5), "presence_penalty", "[-2, 2]"),
        (dict(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
        (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty", "(0, 1000]"),
        (dict(logit_bias={"99999": 5}), "logit_bias[99999]", "outside the vocabulary"),
        (dict(logit_bias={"7": 150}), "logit_bias[7]", "[-100, 100]"),
        (dict(logit_bias={"seven": 1}), "logit_bias", "not a token id"),
        (dict(extra_body={"min_tokens": 9}), "min_tokens", "<= max_tokens"),
        (dict(n=100), "n", "--max-choices"),
        (dict(n=2, best_of=3), "best_of", "must equal n"),
        (dict(extra_body={"bad_words": ["fox", "  "]}), "bad_words[1]", "needs 1 to 256"),
    ],
)
def test_bad_values_are_refused_naming_the_field_and_others_are_served(api, model_name, kwargs, param, words):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        ok = pool.submit(complete, api, model_name)  # served meanwhile
        with pytest.raises(openai.BadRequestError) as err:
            complete(api, model_name, **kwargs)
        assert ok.result().usage.completion_tokens >= 1
    body = err.value.body
    assert body["param"] == param and words in body["message"], body


def test_the_grpc_sdk_carries_the_fields_and_refuses_with_invalid_argument(serve_local_tp2):
    from mmcast_client import Client
    from mmcast_client.errors import InvalidArgument

    messages = [{"role": "user", "content": REPEATING}]
    with Client(serve_local_tp2.target) as sdk:
        plain = sdk.generate(messages, max_tokens=N, ignore_eos=True)
        token = plain.token_ids[0]
        forced = sdk.generate(messages, max_tokens=N, ignore_eos=True, logit_bias={token + 1: 100.0})
        assert forced.token_ids == (token + 1,) * N
        with pytest.raises(InvalidArgument) as err:
            sdk.generate(messages, max_tokens=N, frequency_penalty=2.5)
        assert "sampling.frequency_penalty=2.5 must be in [-2, 2]" in str(err.value)
        assert [v.field for v in err.value.field_violations] == ["sampling.frequency_penalty"]
        assert sdk.generate(messages, max_tokens=N, ignore_eos=True).token_ids == plain.token_ids  # still served


def test_a_client_leaving_an_n_stream_cancels_every_choice(serve_local_tp2, model_name):
    import httpx

    from tests.support.oracle import scrape, wait_until

    metrics = serve_local_tp2.metrics_urls["scheduler"]

    def cancelled() -> float:
        try:
            return scrape(metrics, "mmcast_requests_finished_total", reason="cancelled")
        except KeyError:  # nothing cancelled yet: no labelled sample
            return 0.0

    before = cancelled()
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True, "n": 3}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", serve_local_tp2.openai_base_url + "/completions", json=body) as response:
            assert response.status_code == 200
            indices = set()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    indices.update(c["index"] for c in json.loads(line[6:])["choices"])
                if indices == {0, 1, 2}:
                    break
    wait_until(lambda: cancelled() >= before + 3, 30)
    assert cancelled() == before + 3
    assert scrape(metrics, "mmcast_requests_running") == 0
