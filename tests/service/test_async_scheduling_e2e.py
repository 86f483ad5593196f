"""``--async-scheduling`` on a real TP=2 local group (the scheduler and two ranks as processes): plain decode steps are
planned while the previous one runs, each rank taking the token the group sampled last step as the input (rank 0
broadcasts it to rank 1 on the group's collective). Every answer must still be plain transformers' (tests/support/
oracle.py): image conversations decoding side by side, requests that end in the step before one planned ahead
(length, stop token, stop string), and streams across kill -9 of a rank (the two steps in flight are void; the
requests resume from the tokens already delivered, none repeated or skipped). Constrained requests are planned ahead
too, their masks following the step's control to rank 0 (``StepControl.masks_follow``): their answers follow their
grammars, the greedy unconstrained requests beside them still equal the oracle, and greedy constrained streams across
kill -9 of a rank give exactly the answer of an undisturbed run. The scheduler's
``mmcast_steps_planned_ahead_total`` shows that steps were in fact planned ahead.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal

import jsonschema
import openai
import pytest

from mmcast_client import Client
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.oracle import Oracle, assert_matches, scrape, user_turn, wait_until
from tests.support.pipeline_ends import check_ends_in_a_busy_pipeline, expected_answer

pytestmark = pytest.mark.slow

N = 24  # tokens per image answer


def messages(k: int) -> list[dict]:
    return [user_turn(synthetic_jpeg(8100 + k, (112, 112)), "Tell me everything about this picture.")]


@pytest.fixture(scope="module")
def oracle(tiny_model_dir):
    return Oracle(tiny_model_dir)


@pytest.fixture(scope="module")
def group(tiny_model_dir, oracle):
    with LocalGroup(
        tiny_model_dir,
        2,
        "lazy",
        scheduler_args=["--async-scheduling", "--step-timeout-seconds", "10", "--group-deadline-seconds", "120",
                        "--reconnect-backoff-max-seconds", "0.5"],
        worker_args=["--group-timeout-seconds", "10"],
        ready_timeout=240,
        max_restarts=10,
    ) as g:  # fmt: skip
        yield g


def ahead(group) -> float:
    try:
        return scrape(group.metrics_urls["scheduler"], "mmcast_steps_planned_ahead_total")
    except KeyError:
        return 0.0


def generate(group, k: int):
    with Client(group.target, timeout=300) as c:
        return c.generate(messages(k), max_tokens=N, ignore_eos=True, logprobs=0, temperature=0.0)


def test_image_conversations_decoding_side_by_side_equal_the_oracle(group, oracle):
    before = ahead(group)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda k: generate(group, k), range(3)))
    for k, result in enumerate(results):
        assert result.finish_reason == "length"
        assert_matches(result, oracle(messages(k), N), f"request {k}")
    assert ahead(group) > before  # the decode steps were planned ahead


REGEX = "[a-z]{12}( [a-z]{3,8}){4}"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def constrained(group, seed: int, grammar: dict):
    with Client(group.target, timeout=300) as c:
        text = [{"role": "user", "content": "Describe a person."}]
        return c.generate(text, max_tokens=64, temperature=1.0, seed=seed, structured_output=grammar)


def test_a_constrained_request_alone_has_its_steps_planned_ahead(group):
    before = ahead(group)
    result = constrained(group, 1, {"regex": REGEX})
    assert result.finish_reason == "stop" and re.fullmatch(REGEX, result.text), result.text
    assert ahead(group) >= before + 10  # its decode steps, masks following the controls (not lock-step)


def test_constrained_requests_beside_greedy_ones_follow_their_grammars_and_leave_the_greedy_tokens_alone(group, oracle):
    before = ahead(group)
    grammars = [{"regex": REGEX}, {"json_schema": SCHEMA}] * 2
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        free = [pool.submit(generate, group, k) for k in range(2)]
        bound = [pool.submit(constrained, group, seed, g) for seed, g in enumerate(grammars)]
        free_results, bound_results = [f.result() for f in free], [f.result() for f in bound]
    for k, result in enumerate(free_results):
        assert result.finish_reason == "length"
        assert_matches(result, oracle(messages(k), N), f"greedy request {k} beside constrained ones")
    for grammar, result in zip(grammars, bound_results, strict=True):
        assert result.finish_reason == "stop", (grammar, result.text)
        if "regex" in grammar:
            assert re.fullmatch(REGEX, result.text), result.text
        else:
            jsonschema.validate(json.loads(result.text), SCHEMA)
    assert ahead(group) > before


def test_requests_ending_in_the_step_before_one_planned_ahead_get_exactly_their_tokens(group, oracle):
    from common.processor import load_processor

    tokenizer = load_processor(group.model_dir).tokenizer
    with openai.OpenAI(base_url=group.openai_base_url, api_key="unused", max_retries=0, timeout=120) as api:
        model = api.models.list().data[0].id
        before = ahead(group)
        check_ends_in_a_busy_pipeline(api, model, expected_answer(oracle), tokenizer)
    assert ahead(group) > before


def test_kill_9_of_a_rank_with_steps_planned_ahead_loses_and_repeats_no_token(group, oracle):
    seen = [0] * 3

    def stream(k: int):
        with Client(group.target, timeout=300, first_token_timeout=None) as c:
            s = c.generate(messages(k), max_tokens=N, ignore_eos=True, logprobs=0, temperature=0.0, stream=True)
            for delta in s:
                seen[k] += len(delta.token_ids)
            return s.result

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(stream, k) for k in range(3)]
        assert wait_until(lambda: min(seen) >= 3, 120, 0.01), seen
        generation = group.kill_rank(1, signal.SIGKILL)
        at_kill = list(seen)
        group.wait_restarted(generation, timeout=180)
        results = [f.result(timeout=300) for f in futures]
    for k, result in enumerate(results):
        assert result.finish_reason == "length"
        assert_matches(result, oracle(messages(k), N), f"request {k} (killed at {at_kill[k]} tokens)")
    assert any(n < N for n in at_kill), at_kill  # the kill landed mid-generation


def test_kill_9_of_a_rank_while_constrained_steps_are_planned_ahead_loses_and_repeats_no_token(group):
    # Greedy under a grammar: one answer, whatever the batch; the recovered streams must give exactly it.
    text = [{"role": "user", "content": "Write letters."}]
    regex = "[a-z]{80}"

    def run(stream_seen=None, k=0):
        with Client(group.target, timeout=300, first_token_timeout=None) as c:
            s = c.generate(text, max_tokens=120, temperature=0.0, structured_output={"regex": regex}, stream=True)
            for delta in s:
                if stream_seen is not None:
                    stream_seen[k] += len(delta.token_ids)
            return s.result

    want = run()
    assert want.finish_reason == "stop" and re.fullmatch(regex, want.text), want.text
    seen = [0] * 3
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(run, seen, k) for k in range(3)]
        assert wait_until(lambda: min(seen) >= 3, 120, 0.01), seen
        generation = group.kill_rank(1, signal.SIGKILL)
        at_kill = list(seen)
        group.wait_restarted(generation, timeout=180)
        results = [f.result(timeout=300) for f in futures]
    for k, result in enumerate(results):
        assert (result.finish_reason, result.token_ids) == ("stop", want.token_ids), f"request {k}, killed at {at_kill}"
    assert any(n < len(want.token_ids) for n in at_kill), at_kill  # the kill landed mid-generation
