"""Requests that end while the next step is already on the ranks (tests/service/test_step_order_e2e.py and
test_async_scheduling_e2e.py): a length limit, a stop token and a stop string beside a longer request, each through
the real ``openai`` package, checked against plain transformers' greedy answer cut where the request ends."""

from __future__ import annotations

import concurrent.futures

from tests.support.oracle import LOGPROB_TOLERANCE, Oracle

LONG = 24  # tokens of the companion and of the oracle's answer
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]


def expected_answer(oracle: Oracle) -> tuple[list[int], list[float]]:
    return oracle(MESSAGES, LONG)


def _stream(api, model: str, **kwargs) -> dict:
    """One streamed answer: its text, per-token log-probabilities, finish reason and completion tokens."""
    extra = {"ignore_eos": True, **kwargs.pop("extra", {})}
    stream = api.chat.completions.create(
        model=model,
        messages=MESSAGES,
        temperature=0.0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **kwargs,
    )
    text, logprobs, finish, usage = [], [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.logprobs and choice.logprobs.content:
                logprobs += [t.logprob for t in choice.logprobs.content]
            finish = choice.finish_reason or finish
    return {"text": "".join(text), "logprobs": logprobs, "finish": finish, "tokens": usage.completion_tokens}


def _close(served: list[float], reference: list[float]) -> bool:
    return len(served) == len(reference) and all(
        abs(a - b) < LOGPROB_TOLERANCE for a, b in zip(served, reference, strict=False)
    )


def check_ends_in_a_busy_pipeline(api, model_name: str, expected, tokenizer) -> None:
    """Runs the four requests together, twice; each must get exactly its share of ``expected`` (the oracle's)."""
    tokens, logprobs = expected
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    # A stop token: the first token of the answer that did not occur before it (so the answer ends right there).
    k = next(i for i in range(3, LONG) if tokens[i] not in tokens[:i])
    # A stop string: two characters from the middle of the answer's text.
    stop_at = len(full) // 2
    stop = full[stop_at : stop_at + 2]
    assert stop.strip(), f"the oracle's answer has no usable stop string at {stop_at}: {full!r}"
    cases = {
        "long": dict(max_tokens=LONG),
        "length": dict(max_tokens=5),
        "stop_token": dict(max_tokens=LONG, extra={"stop_token_ids": [tokens[k]]}),
        "stop_string": dict(max_tokens=LONG, stop=[stop]),
    }
    for attempt in range(2):  # twice: the ends fall on other steps of the companion's decode the second time
        with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
            futures = {name: pool.submit(_stream, api, model_name, **kw) for name, kw in cases.items()}
            got = {name: f.result(timeout=300) for name, f in futures.items()}
        what = f"attempt {attempt}: {got}"
        assert got["long"]["text"] == full and got["long"]["finish"] == "length", what
        assert _close(got["long"]["logprobs"], logprobs), what
        assert got["length"]["text"] == tokenizer.decode(tokens[:5], skip_special_tokens=True), what
        assert got["length"]["tokens"] == 5 and got["length"]["finish"] == "length", what
        assert _close(got["length"]["logprobs"], logprobs[:5]), what
        # The stop token is generated (counted, its log-probability returned) and ends the answer.
        assert got["stop_token"]["finish"] == "stop" and got["stop_token"]["tokens"] == k + 1, what
        assert got["stop_token"]["text"] == tokenizer.decode(tokens[:k], skip_special_tokens=True) or got["stop_token"][
            "text"
        ] == tokenizer.decode(tokens[: k + 1], skip_special_tokens=True), what
        assert _close(got["stop_token"]["logprobs"][:k], logprobs[:k]), what
        assert got["stop_string"]["finish"] == "stop", what
        assert got["stop_string"]["text"] == full[: full.index(stop)], what
        # Tokens up to the one completing the stop string; the in-flight step's token is never counted.
        needed = next(n for n in range(1, LONG + 1) if stop in tokenizer.decode(tokens[:n], skip_special_tokens=True))
        assert got["stop_string"]["tokens"] == needed, what
