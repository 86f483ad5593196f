"""Prefix-cache events (scheduler_svc/transport/kv_events.py): a subscriber rebuilds the cache's block set exactly.

The scheduler core runs against simulated ranks (tests/support/sched_sim.py) with its real KVCacheManager, the real
publisher and a real ZeroMQ SUB socket over loopback TCP; the subscriber decodes the wire format as vLLM's own
subscribers do (msgpack arrays, tagged events) and applies the events to a set, which after every phase — prefix
hits, eviction in a pool of a few blocks, preemption, a lost group (a new, empty pool) — must equal the hashes the
KVCacheManager holds.
"""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from scheduler_svc.transport.kv_events import CLEARED, REMOVED, STORED, KVEventPublisher, KVEventSink
from tests.support.sched_sim import Harness, request, text

BLOCK = 16


class Subscriber:
    """vLLM's subscriber loop, reduced: SUB socket, multipart [topic, seq, payload], the events applied in order."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.blocks: set[bytes] = set()
        self.next_seq = 0
        self.messages = 0
        self.bytes = 0  # payload bytes received
        self.counts = {STORED: 0, REMOVED: 0, CLEARED: 0}
        self.stored_events: list[list] = []

    def poll(self, timeout_ms: int) -> bool:
        if not self.socket.poll(timeout_ms):
            return False
        topic, seq, payload = self.socket.recv_multipart()
        seq = int.from_bytes(seq, "big")
        if not self.messages:  # ZeroMQ's late joiner: batches sent before the subscription arrived are not ours
            self.next_seq = seq
        assert seq == self.next_seq, f"batch {seq} after {self.next_seq - 1}: a gap"
        self.next_seq += 1
        self.messages += 1
        self.bytes += len(payload)
        ts, events = msgpack.unpackb(payload, raw=False)
        assert abs(ts - time.time()) < 60
        for event in events:
            kind = event[0]
            self.counts[kind] += 1
            if kind == STORED:
                _, hashes, parent, token_ids, block_size, lora_id, medium = event
                assert block_size == BLOCK and lora_id is None and medium is None
                assert len(token_ids) == len(hashes) * block_size and all(len(h) == 32 for h in hashes)
                assert parent is None or len(parent) == 32
                self.blocks.update(hashes)
                self.stored_events.append(event)
            elif kind == REMOVED:
                _, hashes, medium = event
                assert set(hashes) <= self.blocks, "removed a block never stored"
                self.blocks.difference_update(hashes)
            else:
                assert event == [CLEARED]
                self.blocks.clear()
        return True

    def drain_until(self, publisher: KVEventPublisher, timeout: float = 10) -> None:
        """Reads until every batch the publisher has sent so far arrived, with nothing left in its queue."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if publisher.events == publisher.sink.queued and self.next_seq == publisher.seq:
                return
            self.poll(50)
        raise AssertionError(f"got {self.next_seq} batches, the publisher sent {publisher.seq}")

    def close(self) -> None:
        self.socket.close()


@pytest.fixture
def wire():
    sink = KVEventSink(BLOCK, max_queue=100_000)
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "", sink).start()
    subscriber = Subscriber(publisher.endpoint)
    deadline = time.monotonic() + 10
    while not subscriber.poll(50):  # ZeroMQ's late joiner: publish harmless clears until one arrives
        assert time.monotonic() < deadline, "the subscriber never connected"
        sink.cleared()
    yield sink, publisher, subscriber
    subscriber.close()
    publisher.close()


def cached(h: Harness) -> set[bytes]:
    return set(h.sched.kv._cached)


def test_subscriber_rebuilds_the_cache_through_hits_eviction_preemption_and_a_lost_group(wire):
    sink, publisher, sub = wire
    # 10 blocks: every phase evicts. A grows until B is preempted and B's cached blocks are evicted by A's growth.
    h = Harness("lazy", kv_blocks=10, payload_bytes=512, encoder_tokens=64, max_batched=64, kv_events=sink)
    phases = []
    h.add(request("p1", [text("sys", 40), ("img1", 16), text("q1", 8)], max_tokens=8))
    h.run()
    phases.append("first prompt")
    h.add(request("p2", [text("sys", 40), ("img1", 16), text("q2", 12)], max_tokens=8))  # a prefix hit
    h.run()
    phases.append("prefix hit")
    h.add(request("A", [text("a", 40), ("imgA", 16), text("a2", 8)], max_tokens=90))
    h.add(request("B", [text("b", 20), ("imgB", 16), text("b2", 20)], max_tokens=40))
    records = h.run()
    assert any(r.preempted for r in records), "the phase must preempt"
    phases.append("eviction and preemption")
    sub.drain_until(publisher)
    assert sub.blocks == cached(h), phases[-1]
    assert sub.counts[REMOVED] > 0
    h.add(request("C", [text("c", 30), ("imgC", 16)], max_tokens=20))
    h.sched.schedule()  # a step goes out; the group dies before it returns
    h.lose_group()
    phases.append("lost group")
    h.add(request("D", [text("sys", 40), ("img1", 16), text("q3", 8)], max_tokens=8))
    h.run()
    phases.append("after the new pool")
    sub.drain_until(publisher)
    assert sub.blocks == cached(h), phases[-1]
    assert sub.blocks, "the new pool registered blocks again"
    print(f"\nkv events: {sub.messages} batches, {sub.bytes} payload bytes, {sub.counts}")


def test_block_hashes_carry_the_image_identifiers(wire):
    sink, publisher, sub = wire
    h = Harness("lazy", kv_blocks=64, kv_events=sink)
    h.add(request("x", [("imgX", 32), text("same", 16)], max_tokens=1))
    h.add(request("y", [("imgY", 32), text("same", 16)], max_tokens=1))
    h.run()
    sub.drain_until(publisher)
    by_request = {}
    for _, hashes, _parent, token_ids, *_ in sub.stored_events:
        by_request.setdefault(tuple(token_ids[:BLOCK]), []).append(hashes)
    # Equal token ids (placeholders, then the same text) and yet different blocks: the image is in the hash.
    ((tokens, events),) = by_request.items()
    assert len(events) == 2 and not set(events[0]) & set(events[1])
    assert sub.blocks == cached(h)


def test_a_full_queue_collapses_to_a_clear_and_never_claims_a_block_the_cache_lacks():
    sink = KVEventSink(BLOCK, max_queue=8)  # nobody drains it: the step loop must go on regardless
    h = Harness("lazy", kv_blocks=12, max_batched=64, kv_events=sink)
    for i in range(6):
        h.add(request(f"r{i}", [text(f"t{i}", 40), (f"img{i}", 16)], max_tokens=20))
    h.run()
    assert sink.dropped > 0
    queued = sink.take(0)
    assert queued[0] == [CLEARED] and len(queued) <= 8
    view: set[bytes] = set()
    for event in queued:
        if event[0] == STORED:
            view.update(event[1])
        elif event[0] == REMOVED:
            view.difference_update(event[1])
        else:
            view.clear()
    assert view <= cached(h)


def test_a_subscriber_that_never_reads_does_not_hold_up_the_step_loop():
    sink = KVEventSink(BLOCK, max_queue=100_000)
    publisher = KVEventPublisher("tcp://127.0.0.1:*", "", sink).start()
    stuck = zmq.Context.instance().socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt_string(zmq.SUBSCRIBE, "")
    stuck.connect(publisher.endpoint)
    try:
        h = Harness("lazy", kv_blocks=12, max_batched=32, kv_events=sink)
        for i in range(20):
            h.add(request(f"r{i}", [text(f"t{i}", 40), (f"img{i}", 16)], max_tokens=10))
        h.run()
        deadline = time.monotonic() + 10
        while sink._queue and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not sink._queue and sink.dropped == 0  # the publisher kept up; ZeroMQ dropped the stuck copy
    finally:
        stuck.close()
        publisher.close()


def test_a_taken_endpoint_names_the_flag():
    sink = KVEventSink(BLOCK, max_queue=10)
    first = KVEventPublisher("tcp://127.0.0.1:*", "", sink)
    try:
        with pytest.raises(ValueError, match="--kv-events-endpoint=tcp://127.0.0.1:"):
            KVEventPublisher(first.endpoint, "", sink)
    finally:
        first.close()
