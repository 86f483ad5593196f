"""A closed-loop load through the gRPC SDK, measured the way AIPerf measures its HTTP load, so that the two sit side
by side (``benchmarks/http_api/aiperf_load.py``; ``make bench-aiperf``).

The load is an AIPerf ``single_turn`` JSONL file (one ``{"text": ..., "image": "/path.jpg"}`` per request), the same
file AIPerf reads. ``concurrency`` threads take the entries in order, each keeping one request in flight (AIPerf's
``--concurrency`` with ``--dataset-sampling-strategy sequential``), greedy with ``ignore_eos`` and ``max_tokens``
output tokens. Definitions, as AIPerf's docs give them:

- TTFT: request sent → first token with content (the SDK's deltas with non-empty text, as the HTTP door sends only
  those);
- ITL (AIPerf's "inter token latency", which is TPOT): (request latency − TTFT) ÷ (output tokens − 1);
- request throughput: completed requests ÷ (first request sent → last answer received);
- output token throughput: output tokens ÷ that same duration.

Output tokens are the server's count (``Usage.completion_tokens``); AIPerf runs with ``--use-server-token-count`` for
the same reason: the tiny model's random text does not re-tokenize to the tokens it was made of.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Sequence

from benchmarks.support import stats

PERCENTILES = (50, 90, 99)


def write_dataset(path: str, images, count: int, seed: int, size: tuple[int, int] = (448, 448)) -> list[dict]:
    """``count`` entries, each one never-seen synthetic JPEG and a question; written as AIPerf's single_turn JSONL."""
    from benchmarks.support.scenarios import question

    entries = [
        {"text": f"{question(i)} Describe the picture.", "image": os.path.abspath(images.path(seed + i, size))}
        for i in range(count)
    ]
    with open(path, "w") as f:
        for e in entries:
            f.write(json.dumps(e) + "\n")
    return entries


def _one(client, entry: dict, max_tokens: int) -> dict:
    messages = [
        {
            "role": "user",
            "content": [{"type": "image", "image": entry["image"]}, {"type": "text", "text": entry["text"]}],
        }
    ]
    start = time.perf_counter()
    first = None
    with client.generate(messages, max_tokens=max_tokens, ignore_eos=True, stream=True) as s:
        for delta in s:
            if first is None and delta.text:
                first = time.perf_counter()
    end = time.perf_counter()
    tokens = s.result.usage.completion_tokens
    ttft = ((first or end) - start) * 1e3
    latency = (end - start) * 1e3
    return {
        "start": start,
        "end": end,
        "ttft_ms": ttft,
        "latency_ms": latency,
        "output_tokens": tokens,
        "itl_ms": (latency - ttft) / (tokens - 1) if tokens > 1 else None,
    }


def run(target: str, entries: Sequence[dict], concurrency: int, max_tokens: int, upload_images: bool = True) -> dict:
    """The closed loop: ``concurrency`` threads, one client each (AIPerf's workers each hold their own connection)."""
    from mmcast_client.client import Client

    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    nxt = iter(range(len(entries)))

    def worker() -> None:
        with Client(target, timeout=600, upload_images=upload_images) as client:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                try:
                    r = _one(client, entries[i], max_tokens)
                except Exception as e:  # noqa: BLE001 - counted and reported, as AIPerf counts errors
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                with lock:
                    results.append(r)

    threads = [threading.Thread(target=worker, name=f"sdk-load-{k}") for k in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(results, errors)


def _dist(values: Sequence[float]) -> dict:
    if not values:
        return {}
    out = {"avg": sum(values) / len(values), "min": min(values), "max": max(values), "count": len(values)}
    out.update({f"p{q}": stats.percentile(values, q) for q in PERCENTILES})
    return out


def summarize(results: Sequence[dict], errors: Sequence[str] = ()) -> dict:
    """AIPerf's headline metrics from per-request records (start/end on one clock, in seconds)."""
    if not results:
        return {"request_count": 0, "errors": list(errors)}
    duration = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(r["output_tokens"] for r in results)
    return {
        "request_count": len(results), "errors": list(errors), "benchmark_duration_s": duration,
        "request_throughput": len(results) / duration, "output_token_throughput": tokens / duration,
        "time_to_first_token": _dist([r["ttft_ms"] for r in results]),
        "inter_token_latency": _dist([r["itl_ms"] for r in results if r["itl_ms"] is not None]),
        "request_latency": _dist([r["latency_ms"] for r in results]),
        "output_tokens": _dist([r["output_tokens"] for r in results]),
    }  # fmt: skip
