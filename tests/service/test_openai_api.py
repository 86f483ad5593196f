"""The OpenAI-compatible HTTP API through the real ``openai`` package (sync, async, streaming) against a real
``serve-local`` TP=2 group: multi-turn image conversations whose served text and log-probabilities equal plain
transformers' (tests/support/oracle.py, fed the files as sent) and the gRPC SDK's for the same input, the prefix
cache reported as ``cached_tokens``, images referenced by ``uuid``, cancellation of a stream the client leaves.

Greedy with ``ignore_eos`` (a fixed length) and log-probabilities, as every oracle test asks; a negative control
(one image swapped) shows that the comparison sees the image.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import urllib.request

import httpx
import openai
import pytest

from mmcast_client import Client
from tests.support.oracle import LOGPROB_TOLERANCE, N_TOKENS, Oracle, scrape, wait_until
from tests.support.security_catalogue import jpeg, png

pytestmark = pytest.mark.slow

EXTRA = {"ignore_eos": True}  # vLLM's extra field, as vLLM's users send it
GREEDY = dict(max_tokens=N_TOKENS, temperature=0.0, logprobs=True, extra_body=EXTRA)


def data_url(data: bytes) -> str:
    mime = "image/jpeg" if data[:2] == b"\xff\xd8" else "image/png"
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def sdk_turn(img: bytes, question: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": question}]}


def openai_turn(img: bytes, question: str) -> dict:
    return {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": data_url(img)}}, {"type": "text", "text": question}],
    }


IMG_A, IMG_B, IMG_C = png(112, 112, seed=1), jpeg(84, 112, seed=2), png(56, 56, seed=3)  # noise: features differ


@pytest.fixture(scope="module")
def group(serve_local_tp2):
    return serve_local_tp2


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    return Oracle(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from common.processor import load_processor

    return load_processor(tiny_model_dir).tokenizer


def served_logprobs(choice) -> list[float]:
    return [t.logprob for t in choice.logprobs.content]


def assert_oracle(choice, expected, tokenizer, what: str) -> None:
    tokens, logprobs = expected
    assert choice.message.content == tokenizer.decode(tokens, skip_special_tokens=True), what
    served = served_logprobs(choice)
    assert len(served) == len(logprobs), what
    worst = max(abs(a - b) for a, b in zip(served, logprobs, strict=True))
    assert worst < LOGPROB_TOLERANCE, f"{what}: log-probabilities differ by {worst:.2e}"


def test_models_and_health(group, api, model_name, tiny_model_dir):
    assert model_name == tiny_model_dir.name
    card = api.models.list().data[0]
    assert card.owned_by == "mmcast"
    with urllib.request.urlopen(group.openai_base_url.removesuffix("/v1") + "/health", timeout=10) as r:
        assert r.status == 200


def test_multi_turn_conversation_equals_oracle_and_sdk(group, api, model_name, oracle, tokenizer):
    """Two turns, a new image in each: the second turn's prefix (turn one with its image) is cached, the answer
    still equals transformers run whole, and the gRPC SDK serves the same text for the same input."""
    q1, q2 = "What is in this picture?", "And what about this one?"
    sdk1 = [sdk_turn(IMG_A, q1)]
    first = api.chat.completions.create(model=model_name, messages=[openai_turn(IMG_A, q1)], **GREEDY)
    choice = first.choices[0]
    assert_oracle(choice, oracle(sdk1), tokenizer, "turn 1")
    assert choice.finish_reason == "length" and first.usage.completion_tokens == N_TOKENS

    answer = choice.message.content
    messages = [openai_turn(IMG_A, q1), {"role": "assistant", "content": answer}, openai_turn(IMG_B, q2)]
    sdk2 = [*sdk1, {"role": "assistant", "content": answer}, sdk_turn(IMG_B, q2)]
    second = api.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    assert_oracle(second.choices[0], oracle(sdk2), tokenizer, "turn 2")
    details = second.usage.prompt_tokens_details
    assert details.cached_tokens > 0, second.usage  # turn one and its image came from the prefix cache
    assert second.usage.prompt_tokens > first.usage.prompt_tokens

    with Client(group.target) as sdk:
        via_grpc = sdk.generate(sdk2, max_tokens=N_TOKENS, ignore_eos=True, logprobs=0, temperature=0.0)
    assert via_grpc.text == second.choices[0].message.content
    assert [lp.logprob for lp in via_grpc.logprobs] == pytest.approx(served_logprobs(second.choices[0]), abs=1e-6)

    # Negative control: the same conversation with the second image swapped answers differently.
    swapped = [*messages[:2], openai_turn(IMG_C, q2)]
    other = api.chat.completions.create(model=model_name, messages=swapped, **GREEDY)
    diff = max(
        abs(a - b) for a, b in zip(served_logprobs(other.choices[0]), served_logprobs(second.choices[0]), strict=True)
    )
    assert diff > 10 * LOGPROB_TOLERANCE


def test_streaming_with_usage_equals_whole(api, model_name):
    messages = [openai_turn(IMG_B, "Describe it in detail.")]
    whole = api.chat.completions.create(model=model_name, messages=messages, **GREEDY)
    stream = api.chat.completions.create(
        model=model_name, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    logprobs = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert logprobs == pytest.approx(served_logprobs(whole.choices[0]), abs=1e-6)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == N_TOKENS
    assert usage_chunks[0].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt a moment before


def test_async_client_streams_the_same_answers(group, api, model_name):
    prompts = [[openai_turn(img, "What colour dominates?")] for img in (IMG_A, IMG_B, IMG_C)]
    expected = [
        api.chat.completions.create(model=model_name, messages=m, **GREEDY).choices[0].message.content for m in prompts
    ]

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=group.openai_base_url, api_key="unused", max_retries=0) as client:

            async def one(messages) -> str:
                stream = await client.chat.completions.create(
                    model=model_name, messages=messages, stream=True, **GREEDY
                )
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            return await asyncio.gather(*(one(m) for m in prompts))

    assert asyncio.run(run()) == expected


def test_image_by_uuid(api, model_name):
    """An image sent inline once is referable by ``uuid`` (vLLM's convention) with ``image_url: null``; a uuid the
    server never saw is a 404 in OpenAI's shape naming the field."""
    img = png(56, 84, seed=4)
    inline = api.chat.completions.create(model=model_name, messages=[openai_turn(img, "What is this?")], **GREEDY)
    ref = {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": None, "uuid": "sha256:" + hashlib.sha256(img).hexdigest()},
            {"type": "text", "text": "What is this?"},
        ],
    }
    by_uuid = api.chat.completions.create(model=model_name, messages=[ref], **GREEDY)
    assert by_uuid.choices[0].message.content == inline.choices[0].message.content
    assert served_logprobs(by_uuid.choices[0]) == pytest.approx(served_logprobs(inline.choices[0]), abs=1e-6)

    missing = "sha256:" + hashlib.sha256(b"never sent").hexdigest()
    ref["content"][0]["uuid"] = missing
    with pytest.raises(openai.NotFoundError) as info:
        api.chat.completions.create(model=model_name, messages=[ref], **GREEDY)
    error = info.value.body
    assert error["param"] == "messages[0].content[0].uuid" and missing in error["message"]
    assert error["code"] == "image_not_found"


def test_text_completions_equal_transformers(api, model_name, oracle, tokenizer):
    prompt = "The quick brown fox"
    out = api.completions.create(
        model=model_name, prompt=prompt, max_tokens=N_TOKENS, temperature=0.0, logprobs=0, extra_body=EXTRA
    )
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    tokens, expected = oracle.generate({"input_ids": ids})
    choice = out.choices[0]
    assert choice.text == tokenizer.decode(tokens, skip_special_tokens=True)
    assert choice.logprobs.token_logprobs == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    assert out.usage.prompt_tokens == ids.shape[1] and out.usage.completion_tokens == N_TOKENS


def test_continue_final_message_continues_the_assistant_text(api, model_name, oracle, tiny_model_dir):
    """``continue_final_message`` leaves the last (assistant) turn open: the prompt is the template's own rendering
    with transformers' ``continue_final_message=True`` (no end-of-turn after "The answer is"), and the answer is
    transformers' continuation of it. Both it and ``add_generation_prompt`` true is refused, as vLLM does."""
    messages = [{"role": "user", "content": "Say something."}, {"role": "assistant", "content": "The answer is"}]
    out = api.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=N_TOKENS,
        temperature=0.0,
        logprobs=True,
        extra_body={**EXTRA, "continue_final_message": True, "add_generation_prompt": False},
    )
    text = oracle.processor.apply_chat_template(
        [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in messages],
        tokenize=False,
        continue_final_message=True,
    )
    assert text.endswith("The answer is")
    ids = oracle.processor.tokenizer(text, return_tensors="pt")["input_ids"]
    _, expected = oracle.generate({"input_ids": ids})
    assert out.usage.prompt_tokens == ids.shape[1]
    assert served_logprobs(out.choices[0]) == pytest.approx(expected, abs=LOGPROB_TOLERANCE)
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        api.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=1,
            extra_body={"continue_final_message": True, "add_generation_prompt": True},
        )


def test_text_completions_default_to_16_tokens(api, model_name):
    """/v1/completions without max_tokens generates 16 tokens, as OpenAI's and vLLM's do (not what the context
    leaves)."""
    out = api.completions.create(model=model_name, prompt="Once upon a time", temperature=0.0, extra_body=EXTRA)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length", out.usage


def test_stop_string_and_seeded_sampling(api, model_name):
    messages = [openai_turn(IMG_A, "Tell me a story.")]
    base = (
        api.chat.completions.create(
            model=model_name, messages=messages, max_tokens=12, temperature=0.0, extra_body=EXTRA
        )
        .choices[0]
        .message.content
    )
    stop = base[len(base) // 2 : len(base) // 2 + 2]
    if stop.strip():
        cut = api.chat.completions.create(
            model=model_name, messages=messages, max_tokens=12, temperature=0.0, stop=[stop], extra_body=EXTRA
        ).choices[0]
        assert cut.finish_reason == "stop" and cut.message.content == base[: base.index(stop)]
    hot_greedy = api.chat.completions.create(
        model=model_name, messages=messages, max_tokens=12, temperature=2.0, seed=7, extra_body={**EXTRA, "top_k": 1}
    )  # vLLM's top_k: one token left
    assert hot_greedy.choices[0].message.content == base
    sampled = [
        api.chat.completions.create(
            model=model_name, messages=messages, max_tokens=8, temperature=1.0, seed=1234, extra_body=EXTRA
        )
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]


def test_client_leaving_a_stream_cancels_its_request(group, model_name):
    metrics = group.metrics_urls["scheduler"]

    def cancelled() -> float:
        try:
            return scrape(metrics, "mmcast_requests_finished_total", reason="cancelled")
        except KeyError:  # no request has finished yet: the counter has no labelled sample
            return 0.0

    before = cancelled()
    body = {
        "model": model_name,
        "messages": [openai_turn(IMG_C, "Go on forever.")],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", group.openai_base_url + "/chat/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            seen = 0
            for line in lines:
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                    if seen >= 3:
                        break
    wait_until(lambda: cancelled() > before, 30)
    assert cancelled() == before + 1
    assert scrape(metrics, "mmcast_requests_running") == 0


def test_http_metrics(group):
    text = urllib.request.urlopen(group.metrics_urls["scheduler"], timeout=10).read().decode()
    ok = [
        line
        for line in text.splitlines()
        if line.startswith("mmcast_http_requests_total{")
        and 'route="/v1/chat/completions"' in line
        and 'status="200"' in line
    ]
    assert ok and float(ok[0].rsplit(" ", 1)[1]) >= 1
    assert "mmcast_http_request_duration_seconds_bucket" in text


def test_sse_wire_format(group, model_name):
    """The bytes on the wire: every event a ``data:`` line of one JSON object, the last ``data: [DONE]``."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        r = http.post(group.openai_base_url + "/chat/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    objects = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(o["object"] == "chat.completion.chunk" and o["id"] == objects[0]["id"] for o in objects)
    assert objects[-1]["choices"][0]["finish_reason"] == "length"


def test_the_scheduler_and_every_rank_freeze_their_start_up_heap(group):
    """Each process puts what start-up left alive out of the garbage collector's reach before it serves, so a
    full collection walks only what serving created (common/process.py: freeze_startup_heap): once per start (a
    test of this session may have restarted a process of the shared group)."""
    from common.process import FROZEN_MESSAGE

    for name, started in (("scheduler", "scheduler listening"), ("rank0", "ready"), ("rank1", "ready")):
        records = []
        for line in (group.log_dir / f"{name}.log").read_text().splitlines():
            if line.startswith("{"):
                records.append(json.loads(line))
        frozen = [r for r in records if r.get("msg") == FROZEN_MESSAGE]
        starts = [r for r in records if r.get("msg") == started]
        assert frozen and len(frozen) == len(starts), (name, len(frozen), len(starts))
        assert all(r["gc_frozen_objects"] > 10_000 for r in frozen), (name, frozen)  # torch and transformers alone
