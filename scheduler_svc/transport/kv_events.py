"""Prefix-cache events for pickers outside the process, in vLLM's KV-event format over ZeroMQ PUB.

Off unless ``--kv-events-endpoint`` is set (e.g. ``tcp://*:5557``). Every change of the scheduler's registered block
set (scheduler_svc/core/kv_cache.py) becomes an event; a subscriber that applies them in order holds exactly the set of
block hashes the replica's prefix cache holds, so a picker (llm-d's KV-cache scorer, Dynamo's router, a script) can
send a request to the replica that holds most of its prefix.

Wire format: the one vLLM publishes (vllm.distributed.kv_events, ``ZmqEventPublisher``), so its subscribers read it
unchanged. Each message is a ZeroMQ multipart ``[topic, seq, payload]``: ``topic`` the UTF-8 of
``--kv-events-topic``, ``seq`` the batch number as 8 bytes big-endian (from 0; a gap means the subscriber's HWM
dropped batches), ``payload`` a msgpack array ``[ts, events]`` (msgspec's ``array_like`` struct encoding, tagged
unions) with ``ts`` the publish time (Unix seconds, float) and ``events`` a list of

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

``block_hashes`` are mmcast's own block hashes (32-byte sha256 digests, msgpack bin), which chain the parent hash,
the token ids, the image identifiers of every image overlapping the block and the request's cache salt
(common/hashing.py): a picker must use them as they are and must not recompute hashes from ``token_ids`` (the
image placeholder tokens are equal for every image). ``parent_block_hash`` is the hash of the block before the
first one of the event (None for a prompt's first block); ``token_ids`` are the events' blocks' tokens in order,
``block_size`` tokens each. ``lora_id`` and ``medium`` are always None (no adapters; one KV tier).

The step loop never waits for a subscriber: events go into a bounded queue (``--kv-events-queue`` events) that a
thread drains into the socket (ZeroMQ's send HWM drops for a slow subscriber on its side). When the queue is full
the events in it are dropped and replaced by one ``AllBlocksCleared``: a subscriber then holds fewer blocks than
the cache (those stored since), never a block the cache lacks. ``mmcast_kv_events_dropped_total`` counts them.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"
MAX_BATCH_EVENTS = 1024  # events in one published batch at most (a message stays well under a MiB)
SEND_HWM = 10_000  # batches ZeroMQ keeps per subscriber before it drops for that subscriber


class KVEventSink:
    """What kv_cache.KVCacheManager calls. Thread-safe, never blocks; the events wait in a bounded queue."""

    def __init__(self, block_size: int, max_queue: int, metrics=None) -> None:
        if max_queue < 1:
            raise ValueError(f"kv_events_queue={max_queue} must be >= 1 (--kv-events-queue)")
        self.block_size = block_size  # tokens per block, sent in every BlockStored
        self.max_queue = max_queue  # events queued at most; beyond, the queue collapses to one AllBlocksCleared
        self.metrics = metrics  # SchedulerMetrics or None
        self._queue: collections.deque[list] = collections.deque()
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self.dropped = 0  # events dropped because the queue was full
        self.queued = 0  # events ever put in the queue (an overflow's AllBlocksCleared included)

    def stored(self, block_hashes: Sequence[bytes], parent: bytes | None, token_ids: Sequence[int]) -> None:
        self._put([STORED, list(block_hashes), parent, list(token_ids), self.block_size, None, None])

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        self._put([REMOVED, list(block_hashes), None])

    def cleared(self) -> None:
        self._put([CLEARED])

    def _put(self, event: list) -> None:
        with self._lock:
            if len(self._queue) >= self.max_queue:
                lost = len(self._queue)
                self._queue.clear()
                self._queue.append([CLEARED])  # the subscriber forgets what it can no longer track exactly
                self.queued += 1
                self.dropped += lost
                if self.metrics is not None:
                    self.metrics.kv_events_dropped.inc(lost)
            self._queue.append(event)
            self.queued += 1
            self._ready.notify()

    def take(self, timeout: float) -> list[list]:
        """Up to MAX_BATCH_EVENTS queued events, waiting up to ``timeout`` seconds for the first."""
        with self._lock:
            if not self._queue:
                self._ready.wait(timeout)
            n = min(len(self._queue), MAX_BATCH_EVENTS)
            return [self._queue.popleft() for _ in range(n)]


class KVEventPublisher:
    """A ZeroMQ PUB socket bound to ``endpoint`` and the thread that publishes the sink's events on it."""

    def __init__(self, endpoint: str, topic: str, sink: KVEventSink, metrics=None) -> None:
        import msgpack  # imported only when the flag is set: a scheduler without it never loads ZeroMQ
        import zmq

        self.sink = sink
        self.topic = topic.encode()
        self.metrics = metrics
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(endpoint)
        except zmq.ZMQError as err:
            self._socket.close()
            raise ValueError(f"--kv-events-endpoint={endpoint}: cannot bind ({err})") from None
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # the port chosen for tcp://h:*
        self.seq = 0  # the next batch's number
        self.batches = 0  # batches published
        self.events = 0  # events published (counted after the batch that holds them went to the socket)
        self.bytes = 0  # payload bytes published (topic and seq frames not included)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)

    def start(self) -> KVEventPublisher:
        self._thread.start()
        log.info("publishing prefix-cache events on %s", self.endpoint)
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            events = self.sink.take(0.1)
            if not events:
                continue
            payload = self._pack([time.time(), events])
            # A PUB socket never blocks: past a subscriber's HWM, ZeroMQ drops that subscriber's copy (a seq gap).
            self._socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
            self.seq += 1
            self.batches += 1
            self.events += len(events)
            self.bytes += len(payload)
            if self.metrics is not None:
                for event in events:
                    self.metrics.kv_events.labels(event[0]).inc()
                self.metrics.kv_event_bytes.inc(len(payload))

    def close(self) -> None:
        """Publishes what is queued (for up to a second), then closes the socket."""
        deadline = time.monotonic() + 1.0
        while self.sink._queue and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2)
        self._socket.close()
