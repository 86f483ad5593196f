"""Prefix-cache events from a real scheduler (`--kv-events-endpoint`): one LocalGroup (TP=1) with a pool of a few
blocks, so that its load evicts and preempts, and a ZeroMQ subscriber reading the stream as vLLM's subscribers do.

The exact equality of the rebuilt block set with the KVCacheManager's is tests/scheduler/test_kv_events.py's (it
can read the manager); here the stream of a whole process is checked for what a picker relies on: batches in
sequence, every removed block one it was told of, never more blocks held than the pool has, the counts equal to
the scheduler's own mmcast_kv_events_total, and a conversation's later turn stored under the chain of its earlier
blocks (the parent of its first new block is a block the subscriber holds).
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest

from mmcast_client import Client
from mmcast_local.child_processes import free_ports
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.scheduler.test_kv_events import Subscriber
from tests.support.oracle import scrape, user_turn

pytestmark = pytest.mark.slow

KV_BLOCKS = 32  # 512 tokens: two conversations' growing turns do not fit at once (eviction, preemption)
CONVERSATIONS = 6
TURNS = 3
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def group_and_stream(tiny_model_dir):
    (port,) = free_ports(1)
    endpoint = f"tcp://127.0.0.1:{port}"
    subscriber = Subscriber(endpoint)  # before the scheduler starts: it sees the first pool's AllBlocksCleared
    group = LocalGroup(
        tiny_model_dir,
        1,
        "lazy",
        http_port=None,
        kv_blocks=KV_BLOCKS,
        ready_timeout=600,
        scheduler_args=["--kv-events-endpoint", endpoint],
    ).start()
    try:
        group.wait_ready()
        yield group, subscriber
    finally:
        group.stop()
        subscriber.close()


def conversation(client: Client, n: int) -> None:
    history = []
    for t in range(TURNS):
        history.append(
            user_turn(
                synthetic_jpeg(9000 + 10 * n + t, (112, 112)),
                f"Conversation {n}, picture {t}: describe the colours and shapes you see in detail.",
            )
        )
        result = client.generate(history, max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        history.append({"role": "assistant", "content": result.text})


def test_the_stream_of_a_loaded_replica_is_consistent_and_counted(group_and_stream):
    group, sub = group_and_stream
    metrics = group.metrics_urls["scheduler"]

    def published_by_kind() -> dict:
        return {kind: scrape(metrics, "mmcast_kv_events_total", type=kind) for kind in sub.counts}

    # A PUB socket drops what it sends before a subscription reaches it (the group's first AllBlocksCleared may
    # go out before this subscriber's does): counts are compared from here on, once both sides are quiet.
    while sub.poll(200):
        pass
    base_sub, base_pub = dict(sub.counts), published_by_kind()
    base_bytes = sub.bytes - scrape(metrics, "mmcast_kv_event_bytes_total")
    started = time.monotonic()
    with Client(group.target, timeout=300) as client, concurrent.futures.ThreadPoolExecutor(4) as pool:
        for f in [pool.submit(conversation, client, n) for n in range(CONVERSATIONS)]:
            f.result()

    def received() -> float:
        return sum(sub.counts.values()) - sum(base_sub.values())

    def published() -> float:
        return sum(published_by_kind().values()) - sum(base_pub.values())

    deadline = time.monotonic() + 30
    held_max = 0
    while time.monotonic() < deadline:  # Subscriber.poll checks the sequence and every removal as it reads
        while sub.poll(200):
            held_max = max(held_max, len(sub.blocks))
        if received() == published():
            break
    assert received() == published()
    now = published_by_kind()
    for kind, n in sub.counts.items():
        assert n - base_sub[kind] == now[kind] - base_pub[kind], kind
    assert sub.bytes - scrape(metrics, "mmcast_kv_event_bytes_total") == base_bytes
    assert scrape(metrics, "mmcast_kv_events_dropped_total") == 0
    assert sub.counts["BlockStored"] and sub.counts["BlockRemoved"], sub.counts  # the small pool evicted
    assert 0 < len(sub.blocks) <= held_max <= KV_BLOCKS
    chained = sum(1 for e in sub.stored_events if e[2] is not None)
    assert chained, "no stored run continued an earlier block (later turns extend their conversation's chain)"
    preemptions = scrape(metrics, "mmcast_preemptions_total")
    stored_blocks = sum(len(e[1]) for e in sub.stored_events)
    print(
        f"\nkv events e2e: {CONVERSATIONS} conversations x {TURNS} turns in {time.monotonic() - started:.1f}s, "
        f"--kv-blocks {KV_BLOCKS}: {sub.messages} batches, {sub.bytes} payload bytes, events {sub.counts}, "
        f"{stored_blocks} blocks stored ({chained} runs chained to a parent), {len(sub.blocks)} held at the "
        f"end (at most {held_max}), {preemptions:.0f} preemptions"
    )
