"""The workloads of ``benchmarks/peer/compare.py`` that look for an engine's limit, beside ``peer_workloads``' single requests.

- ``ladder``: the load workload (``peer_workloads.load``: multi-turn conversations, one new image a turn, Poisson
  arrivals) at increasing offered rates, stopping at the first rate the engine fails the SLO (``holds``), at the
  last rate of the plan (the cap) or when the ladder's time budget is spent (``ladder_stops``); when its first
  rate fails, the rates below it (``LoadPlan.below``) are offered down to one held. The lowest rate failed is
  named in the report beside the highest rate held: a ladder that never fails has not found the limit.
- ``closed_loop``: every request sent at once, the engine's batch as large as it makes it: one never-seen image
  per request (``new``), or one image warmed first and sent with every request beside distinct questions
  (``cached``). Request and output-token throughput over the span from the sends to the last token, TTFT p50/p99
  and its spread (max − min: how unevenly a batch of arrivals is served), TPOT, ITL.
- ``burst``: a few long decodes started first; once each streams, a burst of new-image requests arrives at once.
  The decodes' ``max_tokens`` is only an upper bound: the client stops them once the burst has every first token
  and they have streamed a moment longer, so they outlast the burst in either engine however long it lasts (an
  engine whose decodes ended inside the window would have only part of their gaps measured).
  The decodes' inter-token gaps while the burst is being admitted (from its send to its last first token) show
  what the burst's prefill does to conversations already answering; the burst's TTFT spread shows how its
  requests share the engine. Two views of those gaps: every gap that ends in the window (its p50/p99/max, the
  issue's figure), and each decode's *longest stall*, its longest gap overlapping the window (one that spans the
  window's start or end counted whole), with its p50 and max over the decodes. The second is fair to an engine
  that delivers the tokens it produced meanwhile in bunches (vLLM's API server while it preprocesses the burst's
  images): a bunch of N tokens is one long gap and N − 1 gaps of ~0, so its gap p99 reads near zero while its
  decodes waited as long as the long gap; an engine that streams each token as it is sampled shows every wait.
  Both are per content chunk, as a user sees the text: with random weights many tokens are part of a character,
  whose text both servers hold back until the character is whole, so a decode's longest stall may span two or
  three of the steps that produced its tokens (asking for log-probabilities would give every token a chunk of its
  own, but costs vLLM's API server, the bottleneck of its burst, its own work per token).

Every request is greedy with a fixed number of tokens (``ignore_eos``); texts are kept for the token comparison
(the burst's stopped decodes up to the shorter of the two engines' texts).
"""

from __future__ import annotations

import asyncio
import time

from benchmarks.peer.peer_client import PREFIX_KEY, Client, Reply, question, user
from benchmarks.peer.peer_workloads import SEEDS, LoadPlan, Parts, load
from benchmarks.support import stats


def holds(point: dict, slo_ms: float) -> bool:
    """A load point within the SLO: no failed request, p99 TTFT and the p99 of a conversation's wait for its
    previous answer past its scheduled arrival both within it (an engine that falls behind the schedule delays
    the questions, which shows in the wait, not in their TTFT)."""
    if not point.get("completed") or point["failed"]:
        return False
    return point["ttft_p99_ms"] <= slo_ms and point["conversation_wait_p99_ms"] <= slo_ms


def ladder_stops(points: list[dict], slo_ms: float, rates, elapsed_s: float, budget_s: float) -> str | None:
    """Why the ladder offers no further rate ("failed": the last rate failed the SLO; "cap": every rate of the plan
    offered; "budget": its time is spent), or None to offer the next one."""
    if points and not holds(points[-1], slo_ms):
        return "failed"
    if len(points) >= len(rates):
        return "cap"
    if elapsed_s >= budget_s:
        return "budget"
    return None


def first_failing_rate(points: list[dict], slo_ms: float) -> float | None:
    """The lowest offered rate not held (None: every rate offered was held: the limit lies above the ladder)."""
    failed = [p["rate"] for p in points if not holds(p, slo_ms)]
    return min(failed) if failed else None


async def ladder(client: Client, parts: Parts, plan: LoadPlan, slo_ms: float, texts: dict, step) -> dict:
    """``step(name, coro)`` runs one rate (the driver's: it records the engine's CPU seconds into the point)."""
    points: list[dict] = []
    t0 = time.monotonic()
    while (why := ladder_stops(points, slo_ms, plan.rates, time.monotonic() - t0, plan.budget_s)) is None:
        i = len(points)
        points.append(await step(f"load {plan.rates[i]:g}/s", load(client, parts, plan, i, texts)))
    if why == "failed" and len(points) == 1:  # the first rate failed: down the rates below it to one held
        for j, rate in enumerate(plan.below):
            points.append(await step(f"load {rate:g}/s", load(client, parts, plan, len(plan.rates) + j, texts)))
            if holds(points[-1], slo_ms):
                break
    return {"points": points, "stopped": why, "first_failing_rate": first_failing_rate(points, slo_ms),
            "seconds": time.monotonic() - t0}  # fmt: skip


def summarise(rows: list[dict], failed: int) -> dict:
    """Throughput and latency of requests sent together: ``end_s`` is each one's last token from the first send."""
    if not rows:
        return {"completed": 0, "failed": failed}
    duration = max(r["end_s"] for r in rows)
    ttft = [r["ttft_ms"] for r in rows]
    tpot = [r["tpot_ms"] for r in rows if r["tpot_ms"] is not None]
    itl = [x for r in rows for x in r["itl_ms"]]
    return {
        "completed": len(rows), "failed": failed, "duration_s": duration,
        "request_throughput": len(rows) / duration,
        "output_token_throughput": sum(r["completion_tokens"] for r in rows) / duration,
        "ttft_p50_ms": stats.percentile(ttft, 50), "ttft_p99_ms": stats.percentile(ttft, 99),
        "ttft_spread_ms": max(ttft) - min(ttft),
        "tpot_p50_ms": stats.percentile(tpot, 50) if tpot else None,
        "itl_p50_ms": stats.percentile(itl, 50) if itl else None,
        "itl_p99_ms": stats.percentile(itl, 99) if itl else None,
    }  # fmt: skip


def _row(k: int, reply: Reply, start: float) -> dict:
    return {"k": k, "ttft_ms": reply.ttft_ms, "e2e_ms": reply.e2e_ms, "prompt_tokens": reply.prompt_tokens,
            "cached_tokens": reply.cached_tokens, "completion_tokens": reply.completion_tokens,
            "tpot_ms": reply.tpot_ms, "itl_ms": reply.itl_ms, "sent_s": reply.sent_at - start,
            "end_s": reply.sent_at - start + reply.e2e_ms / 1e3}  # fmt: skip


async def _together(client: Client, prompts: list[list[dict]], max_tokens: int, start: float) -> tuple[list, list]:
    replies = await asyncio.gather(*(client.chat(p, max_tokens) for p in prompts), return_exceptions=True)
    ok = [(k, r) for k, r in enumerate(replies) if isinstance(r, Reply)]
    failures = [f"{type(r).__name__}: {r}"[:300] for r in replies if not isinstance(r, Reply)]
    return [(k, r, _row(k, r, start)) for k, r in ok], failures


async def closed_loop(client: Client, parts: Parts, n: int, max_tokens: int, variant: str, texts: dict) -> dict:
    if variant == "cached":
        image = parts(SEEDS["max_cached"])
        await client.chat([user([image], question(0))], max_tokens)  # the image in the prefix cache, untimed
        prompts = [[user([image], question(k + 1))] for k in range(n)]
    elif variant == "new":
        prompts = [[user([parts(SEEDS["max_new"] + k)], question(k))] for k in range(n)]
    else:
        raise ValueError(f"variant {variant!r}: new or cached")
    start = time.monotonic()
    done, failures = await _together(client, prompts, max_tokens, start)
    for k, reply, _ in done:
        texts[f"max_{variant}/k{k}"] = reply.text
    rows = [row for _, _, row in done]
    return {"variant": variant, "requests": n, **summarise(rows, len(failures)), "failures": failures[:5],
            "rows": rows}  # fmt: skip


def gaps_in_window(chunk_times_s: list[float], lo: float, hi: float) -> list[float]:
    """Inter-chunk gaps (ms) of one stream whose later chunk arrived within [lo, hi] (absolute seconds)."""
    return [1e3 * (b - a) for a, b in zip(chunk_times_s, chunk_times_s[1:], strict=False) if lo < b <= hi]


def longest_stall(chunk_times_s: list[float], lo: float, hi: float) -> float | None:
    """The longest gap (ms) of one stream that overlaps [lo, hi] (absolute seconds): its longest wait for a chunk
    while the burst was admitted, a gap spanning the window's start or end counted whole; None when no gap of it
    overlaps the window (it ended before the burst)."""
    gaps = [1e3 * (b - a) for a, b in zip(chunk_times_s, chunk_times_s[1:], strict=False) if b > lo and a < hi]
    return max(gaps) if gaps else None


async def burst(client: Client, parts: Parts, decodes: int, decode_tokens: int, n: int, max_tokens: int,
                texts: dict, settle_s: float = 0.3) -> dict:  # fmt: skip
    image = parts(SEEDS["warmup"])  # in the prefix cache since the warm-up: the decodes start streaming at once
    firsts = [asyncio.Event() for _ in range(decodes)]
    stop = asyncio.Event()  # set once the burst has every first token and the decodes have settled again
    decodes_sent = time.monotonic()
    running = [asyncio.create_task(client.stream_lean([user([image], question(200 + k))], decode_tokens, firsts[k],
                                                      stop))
               for k in range(decodes)]  # fmt: skip
    for event, task in zip(firsts, running, strict=True):  # each decode streams (or failed) before the burst
        waiter = asyncio.create_task(event.wait())
        await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
    await asyncio.sleep(settle_s)  # the decodes in their steady state
    start = time.monotonic()
    prompts = [[user([parts(SEEDS["burst"] + k)], question(k))] for k in range(n)]
    done, failures = await _together(client, prompts, max_tokens, start)
    await asyncio.sleep(settle_s)  # a stall that spans the window's end ends with the decodes' next chunk
    stop.set()
    finished = await asyncio.gather(*running, return_exceptions=True)
    decode_replies = [r for r in finished if isinstance(r, Reply)]
    failures += [f"decode {type(r).__name__}: {r}"[:300] for r in finished if not isinstance(r, Reply)]
    for k, reply, _ in done:
        texts[f"burst/k{k}"] = reply.text
    for k, reply in enumerate(finished):
        if isinstance(reply, Reply):  # stopped at a point of the client's choosing: compared up to the shorter
            texts[f"{PREFIX_KEY}burst_decode/k{k}"] = reply.text
    rows = [row for _, _, row in done]
    window_end = max((start + r["sent_s"] + r["ttft_ms"] / 1e3 for r in rows), default=start)
    in_window, every_gap, stalls = [], [], []
    for reply in decode_replies:
        times = [reply.sent_at + c / 1e3 for c in reply.chunk_ms]
        in_window += gaps_in_window(times, start, window_end)
        every_gap += reply.itl_ms
        stalls.append(longest_stall(times, start, window_end))
    measured = [x for x in stalls if x is not None]
    first_decode_end = min((r.sent_at + r.chunk_ms[-1] / 1e3 for r in decode_replies), default=start)
    summary = summarise(rows, len(failures))
    return {
        "decodes": decodes, "decode_tokens": decode_tokens, "requests": n, **summary,
        "burst_window_s": window_end - start,
        "decode_itl_p50_in_burst_ms": stats.percentile(in_window, 50) if in_window else None,
        "decode_itl_p99_in_burst_ms": stats.percentile(in_window, 99) if in_window else None,
        "decode_itl_max_in_burst_ms": max(in_window) if in_window else None,
        "decode_itl_p99_ms": stats.percentile(every_gap, 99) if every_gap else None,
        # per decode, its longest gap overlapping the window; p50 and max over the decodes
        "decode_stall_ms": stalls,
        "decode_stall_p50_ms": stats.percentile(measured, 50) if measured else None,
        "decode_stall_max_ms": max(measured) if measured else None,
        # the decodes' first content chunks and the burst's send, from the decodes' send: a server that holds a
        # stream's first chunks back (vLLM's API server on a busy machine) starts the burst late
        "decode_ttft_s": [r.ttft_ms / 1e3 for r in decode_replies], "burst_sent_s": start - decodes_sent,
        # when a decode ended before the burst's last first token, the in-burst gaps cover only part of it
        "decodes_outlasted_burst": first_decode_end >= window_end and len(decode_replies) == decodes,
        "failures": failures[:5], "rows": rows,
    }  # fmt: skip
