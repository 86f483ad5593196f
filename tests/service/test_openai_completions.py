"""``/v1/completions`` as OpenAI's clients use it, through the real ``openai`` package against the shared
``serve-local`` TP=2 group: prompt lists (strings, token arrays) with one choice each and the usage summed, ``echo``,
``max_tokens`` bounded by the context (not a flag), a reused ``x-request-id``, and a cut inside a character.

Every served text is compared with plain transformers (tests/support/oracle.py) fed the prompt as sent."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from scheduler_svc.engine.request_log import FINISHED_MESSAGE
from tests.support.oracle import Oracle, wait_until

pytestmark = pytest.mark.slow

EXTRA = {"ignore_eos": True}
PROMPTS = ["The quick brown fox", "A red circle"]


@pytest.fixture(scope="module")
def group(serve_local_tp2):
    return serve_local_tp2


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    return Oracle(tiny_model_dir)


def ids_of(oracle, prompt: str) -> list[int]:
    return oracle.processor.tokenizer(prompt)["input_ids"]


def expected_text(oracle, prompt: str, n: int) -> str:
    import torch

    tokens, _ = oracle.generate({"input_ids": torch.tensor([ids_of(oracle, prompt)])}, n)
    return oracle.processor.tokenizer.decode(tokens, skip_special_tokens=True)


def greedy(**kw) -> dict:
    return dict(max_tokens=6, temperature=0.0, extra_body=EXTRA) | kw


def test_prompt_lists_give_one_choice_per_prompt(api, model_name, oracle):
    """A list of strings, a list of token arrays and one token array: one choice per prompt, in order, each equal
    to transformers' continuation of that prompt; the usage is the sum of the prompts'."""
    expected = [expected_text(oracle, p, 6) for p in PROMPTS]
    ids = [ids_of(oracle, p) for p in PROMPTS]
    for prompt in (PROMPTS, ids):
        out = api.completions.create(model=model_name, prompt=prompt, **greedy())
        assert [c.index for c in out.choices] == [0, 1]
        assert [c.text for c in out.choices] == expected
        assert out.usage.prompt_tokens == sum(map(len, ids)) and out.usage.completion_tokens == 12
    single = api.completions.create(model=model_name, prompt=ids[1], **greedy())
    assert [c.text for c in single.choices] == expected[1:] and single.usage.prompt_tokens == len(ids[1])


def test_prompt_list_streams_each_choice(api, model_name):
    whole = api.completions.create(model=model_name, prompt=PROMPTS, **greedy())
    texts, finishes = ["", ""], {}
    stream = api.completions.create(
        model=model_name, prompt=PROMPTS, stream=True, stream_options={"include_usage": True}, **greedy()
    )
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices]
    assert finishes == {0: "length", 1: "length"} and usage.completion_tokens == 12


def test_prompt_list_refusals_name_the_prompt_and_the_limit(api, model_name, group):
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=model_name, prompt=["x"] * 33, max_tokens=1)
    assert "--max-prompts-per-request" in info.value.message and info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=model_name, prompt=[[5, 6], [7, 10**6]], max_tokens=1)
    assert info.value.body["param"] == "prompt[1][1]" and "vocabulary" in info.value.message
    assert api.completions.create(model=model_name, prompt="still serving", max_tokens=1).choices


def test_echo_puts_the_prompt_first(api, model_name, oracle):
    out = api.completions.create(model=model_name, prompt=PROMPTS, echo=True, **greedy())
    assert [c.text for c in out.choices] == [p + expected_text(oracle, p, 6) for p in PROMPTS]
    streamed = "".join(
        c.choices[0].text
        for c in api.completions.create(model=model_name, prompt=PROMPTS[0], echo=True, stream=True, **greedy())
    )
    assert streamed == out.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=model_name, prompt="hi", echo=True, logprobs=1, max_tokens=2)
    assert info.value.body["param"] == "echo" and info.value.body["code"] == "unsupported"


def test_max_tokens_is_bounded_by_the_context_not_a_flag(api, model_name, group):
    """``max_tokens`` above the old 4096 default of ``--max-tokens-limit`` is served when it fits the context; past
    the context, the refusal names the context and the prompt's tokens, not a flag."""
    context = api.models.list().data[0].model_extra["max_model_len"]
    assert context > 6000
    stream = api.completions.create(model=model_name, prompt="Go on", max_tokens=6000, stream=True)
    first = next(iter(stream))
    stream.close()  # admitted and generating: leaving cancels it
    assert first.choices[0].index == 0
    with pytest.raises(openai.BadRequestError) as info:
        api.completions.create(model=model_name, prompt="Go on", max_tokens=context)
    message = info.value.message
    assert f"over the context of {context} tokens" in message and "prompt tokens" in message, message
    assert "--max-tokens-limit" not in message


def test_a_reused_request_id_is_served(group, model_name):
    """Two requests with the same ``x-request-id`` at once are both served and both echo it (vLLM serves them too);
    the engine's own ids stay distinct."""
    body = {"model": model_name, "prompt": "Go on", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    headers = {"x-request-id": "same-id-twice"}

    async def run() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=group.openai_base_url, timeout=60) as http:
            async with http.stream("POST", "/completions", json=body, headers=headers) as running:
                lines = running.aiter_lines()  # kept open: leaving the iterator would close the stream
                while not (await anext(lines)).startswith("data: "):
                    pass  # the first request is generating now
                second = await http.post(
                    "/completions", json={**body, "stream": False, "max_tokens": 2}, headers=headers
                )
                return running, second

    running, second = asyncio.run(run())
    assert running.status_code == 200 and second.status_code == 200, second.text
    assert running.headers["x-request-id"] == second.headers["x-request-id"] == "same-id-twice"
    assert second.json()["choices"][0]["finish_reason"] == "length"

    def engine_ids() -> list[str]:
        lines = (group.log_dir / "scheduler.log").read_text(errors="replace").splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{") and "same-id-twice" in line]
        return [r["request_id"] for r in records if r.get("msg") == FINISHED_MESSAGE]

    wait_until(lambda: len(engine_ids()) == 2, 30)
    first, reused = sorted(engine_ids(), key=len)  # the first keeps the id; one sent while it ran gets a suffix
    assert first == "same-id-twice" and re.fullmatch(r"same-id-twice\.[0-9a-f]{12}", reused), engine_ids()


def test_a_cut_inside_a_character_ends_before_it(api, model_name, oracle):
    """``max_tokens`` ending inside a multi-byte character: the served text ends before the character (what a full
    decode shows as U+FFFD is held back), whole or streamed, with a pending stop string too."""
    import torch

    tokenizer = oracle.processor.tokenizer
    prompt = "漢字かな"
    tokens, _ = oracle.generate({"input_ids": torch.tensor([ids_of(oracle, prompt)])}, 64)

    def text(k: int) -> str:
        return tokenizer.decode(tokens[:k], skip_special_tokens=True)

    cuts = [k for k in range(1, 64) if text(k).endswith("\ufffd")]
    assert cuts, "the greedy continuation never ends inside a character: pick another prompt"
    # best: a cut the next token completes into a character (an incomplete sequence, not an invalid byte)
    cut = next((k for k in cuts if text(k + 1).count("\ufffd") < text(k).count("\ufffd")), cuts[0])
    expected = text(cut).rstrip("\ufffd")
    for extra in ({}, {"stop": ["\ufffd\ufffd\ufffd"]}):
        whole = api.completions.create(model=model_name, prompt=prompt, **greedy(max_tokens=cut, **extra))
        assert whole.choices[0].text == expected
        stream = api.completions.create(model=model_name, prompt=prompt, stream=True, **greedy(max_tokens=cut, **extra))
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected


def test_metrics_on_the_http_port(group):
    """Without authentication ``/metrics`` on the API port serves the registry the metrics port serves."""
    with httpx.Client(timeout=30) as http:
        metrics_port = http.get(group.metrics_urls["scheduler"])
        api_port = http.get(group.openai_base_url.removesuffix("/v1") + "/metrics")
    assert api_port.status_code == 200 and api_port.headers["content-type"].startswith("text/plain")
    names = {line.split(" ")[2] for line in api_port.text.splitlines() if line.startswith("# TYPE")}
    # the same registry; series first labelled between the two scrapes appear in the second only
    assert names >= {line.split(" ")[2] for line in metrics_port.text.splitlines() if line.startswith("# TYPE")}
    assert "mmcast_requests_running" in names


def test_leaving_a_prompt_list_stream_cancels_every_prompt(group, model_name):
    from tests.support.oracle import scrape, wait_until

    metrics = group.metrics_urls["scheduler"]

    def cancelled() -> float:
        try:
            return scrape(metrics, "mmcast_requests_finished_total", reason="cancelled")
        except KeyError:
            return 0.0

    before = cancelled()
    body = {"model": model_name, "prompt": PROMPTS, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", group.openai_base_url + "/completions", json=body) as response:
            assert response.status_code == 200
            indices = set()
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    indices.add(json.loads(line[6:])["choices"][0]["index"])
                    if indices == {0, 1}:
                        break
    wait_until(lambda: cancelled() >= before + 2, 30)
    assert cancelled() == before + 2
    wait_until(lambda: scrape(metrics, "mmcast_requests_running") == 0, 10)
