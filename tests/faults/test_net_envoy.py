"""Envoy in front of two replicas (deploy/envoy/envoy.yaml as is), one replica partitioned away mid-load; the clients
are the real OpenAI package with its retries. Each replica (scheduler + one rank) and Envoy live in network
namespaces of their own (tests/support/net_envoy.py). Long run only (make chaos).

What must hold: every request completes equal to the oracle (text and log-probabilities), or fails with a clear
status, never hanging past the client's deadline; Envoy's health checks take the partitioned replica out and put it
back once the link returns; the replica left alone serves everything meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import openai
import pytest

from tests.faults.test_net_partitions import lab
from tests.support.net_envoy import EdgeEnvoy
from tests.support.net_group import NetGroup
from tests.support.net_traffic import report
from tests.support.oracle import LOGPROB_TOLERANCE, Oracle

pytestmark = [pytest.mark.slow, pytest.mark.chaos]
__all__ = ["lab"]  # the namespaces fixture, shared with test_net_partitions.py

CLIENTS = 8
LOAD_SECONDS = 40.0
PARTITION_AT, PARTITION_S = 8.0, 20.0  # replica 0 cut off from t=8 s to t=28 s of the load
CLIENT_TIMEOUT = 8.0  # the OpenAI client's per-attempt timeout; it retries (max_retries) after it
N_TOKENS = 8


@pytest.fixture(scope="module")
def edge(lab, tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("netfault-envoy")
    groups = []
    try:
        for name in ("a", "b"):
            group = NetGroup(
                lab,
                tiny_model_dir,
                1,
                "lazy",
                name=name,
                scheduler_args=["--keepalive-seconds", "2", "--step-timeout-seconds", "15"],
                env=dict(os.environ, PYTHONFAULTHANDLER="1"),
                log_dir=folder / name,
                ready_timeout=240,
            )
            groups.append(group.start())
        for g in groups:
            g.wait_ready()
        with EdgeEnvoy(lab, groups, folder) as envoy:
            yield envoy
    finally:
        for g in groups:
            g.stop()


def test_a_replica_partitioned_away_behind_envoy(edge, tiny_model_dir):
    oracle = Oracle(tiny_model_dir)
    tokenizer = oracle.processor.tokenizer
    prompts = [f"Conversation {k}: tell me about the number {k}." for k in range(64)]
    expected = {}
    for p in prompts:
        tokens, logprobs = oracle([{"role": "user", "content": p}], N_TOKENS)
        expected[p] = (tokenizer.decode(tokens, skip_special_tokens=True), logprobs)
    model = os.path.basename(str(tiny_model_dir))
    outcomes: list[tuple[float, float, str, object]] = []  # (start, seconds, prompt, replica index or exception)
    lock = threading.Lock()
    t0 = time.monotonic()

    def client(c: int) -> None:
        api = openai.OpenAI(base_url=edge.base_url + "/v1", api_key="x", max_retries=4, timeout=CLIENT_TIMEOUT)
        k = c
        while time.monotonic() - t0 < LOAD_SECONDS:
            p = prompts[k % len(prompts)]
            k += CLIENTS
            start = time.monotonic()
            try:
                raw = api.chat.completions.with_raw_response.create(
                    model=model,
                    messages=[{"role": "user", "content": p}],
                    max_tokens=N_TOKENS,
                    temperature=0.0,
                    logprobs=True,
                    extra_body={"ignore_eos": True},
                )
                out = raw.parse()
                text, logprobs = expected[p]
                choice = out.choices[0]
                served = [t.logprob for t in choice.logprobs.content]
                ok = choice.message.content == text and served == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
                result: object = edge.replica_of(raw.headers["x-mmcast-replica"]) if ok else AssertionError(p)
            except Exception as exc:  # noqa: BLE001 - reported and checked below
                result = exc
            with lock:
                outcomes.append((start - t0, time.monotonic() - start, p, result))

    def partition() -> None:
        time.sleep(PARTITION_AT)
        edge.lab.partition(edge.groups[0].sched)
        time.sleep(PARTITION_S)
        edge.lab.heal(edge.groups[0].sched)

    with concurrent.futures.ThreadPoolExecutor(CLIENTS + 1) as pool:
        futures = [pool.submit(client, c) for c in range(CLIENTS)] + [pool.submit(partition)]
        for f in futures:
            f.result(timeout=LOAD_SECONDS + 5 * CLIENT_TIMEOUT * 5)
    edge.wait_healthy(2, timeout=60)  # the healed replica is back in Envoy's table

    wrong = [o for o in outcomes if isinstance(o[3], AssertionError)]
    failed = [o for o in outcomes if isinstance(o[3], Exception) and not isinstance(o[3], AssertionError)]
    during = [o for o in outcomes if PARTITION_AT <= o[0] < PARTITION_AT + PARTITION_S]
    slowest = max(o[1] for o in outcomes)
    served_by_replica0 = sum(1 for o in during if o[3] == 0 and o[0] > PARTITION_AT + CLIENT_TIMEOUT)
    statuses: dict[str, int] = {}
    for o in failed:
        statuses[type(o[3]).__name__] = statuses.get(type(o[3]).__name__, 0) + 1
    report(
        "envoy_replica_partitioned_20s",
        sent=len(outcomes),
        completed=len(outcomes) - len(failed) - len(wrong),
        failed=statuses,
        wrong_tokens=len(wrong),
        during_partition=len(during),
        served_by_replica0_during=served_by_replica0,
        slowest_request_s=slowest,
    )
    assert not wrong, wrong[:3]
    for start, _took, p, exc in failed:  # a failure is the client's own deadline, never a wrong answer or a hang
        assert isinstance(exc, (openai.APITimeoutError, openai.APIStatusError)), (start, p, repr(exc))
    assert slowest < CLIENT_TIMEOUT * 5 + 30, "a request outlived its client's deadlines"
    assert len(during) > 0
    assert served_by_replica0 == 0, "a partitioned replica answered"
