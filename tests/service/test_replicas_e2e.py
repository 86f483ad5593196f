"""Scale-out end to end: three replicas (three LocalGroups, TP=1 each, the code behind `mmcast serve-local`) behind
one SDK `Client` on a multi-address target, as docs/DEPLOYMENT.md's client-side recipe has it.

- ring hash (the SDK's default): each conversation's turns land on the replica holding its prefix, so every turn
  after the first is served mostly from the prefix cache; answers equal the oracle's;
- a replica killed (SIGKILL) between two turns: its conversations continue on the ring's next replica, correctly;
- round robin with uploads on: a turn's upload and its generate land on different replicas, and still no
  NOT_FOUND reaches the caller (the SDK retries with the images inline).
"""

from __future__ import annotations

import concurrent.futures
import os
import signal

import pytest

from mmcast_client import Client
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.oracle import GENERATE, Oracle, assert_matches, scrape, user_turn
from tests.support.replicas import replicas

pytestmark = pytest.mark.slow

REPLICAS = 3
TURNS = 4
IMAGE_SIZE = (112, 112)  # 4 x 4 merged patches: 16 image tokens a turn
# A long first message, so that one block (16 tokens) left uncovered is well under 10 % of a turn's prompt.
OPENING = (
    "Conversation {n}. You are looking at a series of small synthetic pictures, one per question. For each one, "
    "describe the colours, the shapes, the brightness and the texture, say how it differs from the pictures before "
    "it, and keep a running list of every colour you have seen so far in this conversation."
)
FOLLOW_UP = "Here is picture {t} of conversation {n}. What changed compared with the previous one?"


def image(n: int, t: int) -> bytes:
    return synthetic_jpeg(5000 + 10 * n + t, IMAGE_SIZE)


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> Oracle:
    return Oracle(tiny_model_dir)


@pytest.fixture(scope="module")
def groups(tiny_model_dir):
    with replicas(tiny_model_dir, REPLICAS, ready_timeout=240) as started:
        yield started


def target(groups) -> str:
    return "ipv4:" + ",".join(g.target for g in groups)


def run_conversation(client: Client, n: int, turns: range, history: list[dict]) -> list:
    """Turns `turns` of conversation `n` appended to `history`; the results of those turns."""
    results = []
    for t in turns:
        text = OPENING.format(n=n) if t == 0 else FOLLOW_UP.format(n=n, t=t)
        history.append(user_turn(image(n, t), text))
        result = client.generate(history, **GENERATE)
        results.append((list(history), result))
        history.append({"role": "assistant", "content": result.text})
    return results


def run_all(client: Client, conversations: range, turns: range, histories: dict) -> dict[int, list]:
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = {
            n: pool.submit(run_conversation, client, n, turns, histories.setdefault(n, [])) for n in conversations
        }
        return {n: f.result() for n, f in futures.items()}


def check_answers(oracle: Oracle, results: dict[int, list], what: str) -> None:
    for n, turns in results.items():
        for t, (messages, result) in enumerate(turns):
            assert_matches(result, oracle(messages), f"{what}: conversation {n} turn {t + 1}")


def test_ring_hash_keeps_each_conversation_on_the_replica_with_its_prefix(groups, oracle):
    histories: dict = {}
    base = [query_tokens(g) for g in groups]
    with Client(target(groups), timeout=300) as client:
        results = run_all(client, range(6), range(TURNS), histories)
    check_answers(oracle, results, "ring hash")
    for n, turns in results.items():
        usage = [r.usage for _, r in turns]
        for t in range(1, TURNS):
            assert usage[t].cached_tokens >= 0.9 * usage[t - 1].prompt_tokens, (n, t, usage)
    # The ring's places depend on the replicas' ports, so six conversations all land on one replica in ~0.4 % of
    # runs; eighteen more one-turn sessions make "the keys spread over the replicas" fail only if the ring is broken.
    with Client(target(groups), timeout=300) as client:
        for k in range(18):
            client.generate([{"role": "user", "content": f"Session {k}."}], max_tokens=1, session_id=f"spread-{k}")
    served = [query_tokens(g) - b for g, b in zip(groups, base, strict=True)]
    assert sum(x > 0 for x in served) >= 2, served


def test_round_robin_with_uploads_never_shows_not_found(groups, oracle):
    histories: dict = {}
    options = [("grpc.lb_policy_name", "round_robin")]
    before = not_found_answers(groups)
    with Client(target(groups), timeout=300, options=options, upload_images=True) as client:
        results = run_all(client, range(100, 103), range(TURNS), histories)  # any NOT_FOUND would raise here
    check_answers(oracle, results, "round robin")
    assert not_found_answers(groups) > before  # replicas did miss uploads made elsewhere; the SDK hid it


def test_a_killed_replicas_conversations_complete_on_the_next(groups, oracle):
    histories: dict = {}
    conversations = range(200, 206)
    base = [query_tokens(g) for g in groups]
    with Client(target(groups), timeout=300) as client:
        first = run_all(client, conversations, range(2), histories)
        served = [query_tokens(g) - b for g, b in zip(groups, base, strict=True)]
        victim = max(range(REPLICAS), key=lambda i: served[i])  # the replica holding the most conversations
        assert served[victim] > 0
        for pid in groups[victim].pids().values():  # a crash: no goodbye, the connections just reset
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        groups[victim].stop()  # and it stays down (its supervisor would restart it)
        rest = run_all(client, conversations, range(2, TURNS), histories)
    check_answers(oracle, first, "before the kill")
    check_answers(oracle, rest, "after the kill")
    for n in conversations:  # the moved conversations paid one miss (turn 3); turn 4 is a hit again
        usage = [r.usage for _, r in first[n] + rest[n]]
        assert usage[3].cached_tokens >= 0.9 * usage[2].prompt_tokens, (n, usage)


def not_found_answers(groups) -> float:
    """Generate calls the replicas answered with NOT_FOUND (an uploaded image they do not hold)."""
    return sum(
        scrape(g.metrics_urls["scheduler"], "grpc_server_handled_total", grpc_method="Generate", grpc_code="NotFound")
        for g in groups
    )


def query_tokens(group: LocalGroup) -> float:
    """Prompt tokens the replica has admitted so far (its prefix-cache queries)."""
    return scrape(group.metrics_urls["scheduler"], "mmcast_prefix_cache_query_tokens_total")
