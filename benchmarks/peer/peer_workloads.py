"""The workloads of ``benchmarks/peer/compare.py``, each run the same way against one engine's OpenAI base URL.

- ``cached``: the seed's experiment. N distinct images in one user turn, sent once to fill the prefix cache, then
  the same turn, a fixed assistant reply and a new question, timed ``repeats`` times: TTFT against N; its slope is
  what a cached image still costs (the client resends its bytes every time, as an OpenAI client does).
- ``new``: N never-seen images per request (fresh seeds every request; the same seeds on every engine): the slope
  is what one new image costs, decode, encoder and prefill.
- ``load``: C multi-turn conversations, one new image and a question per turn with the whole history resent,
  requests arriving as a Poisson process at a fixed rate (one seeded schedule for every engine); a conversation's
  next turn waits for its previous answer, as a chat user does (the wait is recorded). TTFT p50/p99, TPOT, ITL,
  request and output-token throughput.
  The load workload is offered at a ladder of rates (``benchmarks/peer/peer_capacity.py``) until the engine fails the
  SLO; the closed-loop and burst workloads are there too.
- ``sliding``: one conversation keeping only its last k images (older turns dropped), so the prefix cache misses
  from the first image on once the window slides: TTFT and cached tokens per turn.
- ``video`` (``video_cached``, ``video_new``, ``video_stream``): synthetic MP4s of a panning camera
  (``mmcast_local.synthetic_video``; 2 s at 8 fps, 320x180), each a ``video_url`` data URL sampled at 2 fps
  (``peer_client.video_body``). Cached: N = 1, 2, 4, 8 distinct clips in one user turn, sent once to fill the
  prefix cache, then the turn, the fixed answer and a new question, timed ``repeats`` times: the TTFT slope per
  cached clip. New: one never-seen clip and a question per request: TTFT p50. Stream: turn t brings segment t of
  one stream, the prompt rebuilt as one user turn of the last ``window`` segments and a question, so once the
  window slides the prefix differs from the first segment on: TTFT per turn after the window filled (turn >
  window). Every video row keeps its prompt token count under its key: both engines must sample the same frames
  (``peer_analysis.video_prompt_tokens``).

Every request is greedy with a fixed number of tokens (``ignore_eos``); its text is kept under a key naming its
input, so the engines' tokens can be compared request by request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time

from benchmarks.peer import peer_stages
from benchmarks.peer.peer_client import Client, Reply, assistant, image_part, question, user, video_body, video_part
from benchmarks.support import stats

SEEDS = {"warmup": 9000, "cached": 10_000, "new": 20_000, "load": 30_000, "sliding": 40_000, "max_new": 50_000,
         "max_cached": 60_000, "burst": 70_000, "video_cached": 80_000, "video_new": 81_000, "video_stream": 82_000,
         "video_warmup": 83_000}  # fmt: skip


class Parts:
    """Image parts (base64 data: URLs) by seed and size, encoded once before anything is timed."""

    def __init__(self, images) -> None:
        self.images = images  # benchmarks.support.scenarios.Images
        self._parts: dict[tuple[int, tuple[int, int]], dict] = {}

    def __call__(self, seed: int, size: tuple[int, int] | None = None) -> dict:
        size = size or self.images.size
        key = (seed, size)
        if key not in self._parts:
            with open(self.images.path(seed, size), "rb") as f:
                self._parts[key] = image_part(f.read())
        return self._parts[key]


class VideoParts:
    """Video parts (base64 data: URLs of synthetic MP4 segments) by (stream seed, segment), encoded once before
    anything is timed; segment 0 of a seed is a clip of its own."""

    SECONDS, FPS, SIZE = 2.0, 8, (320, 180)
    LABEL = "320x180, 2 s at 8 fps (h264 MP4), sampled at 2 fps"

    def __init__(self) -> None:
        self._parts: dict[tuple[int, int], dict] = {}

    def __call__(self, seed: int, index: int = 0) -> dict:
        from mmcast_local.synthetic_video import stream_segment

        if (seed, index) not in self._parts:
            mp4 = stream_segment(seed, index, seconds=self.SECONDS, fps=self.FPS, size=self.SIZE)
            self._parts[(seed, index)] = video_part(mp4)
        return self._parts[(seed, index)]


@dataclasses.dataclass(frozen=True)
class VideoPlan:
    ns: tuple[int, ...] = (1, 2, 4, 8)  # cached clips
    repeats: int = 3  # timed questions per N
    new_repeats: int = 3  # requests of one new clip
    turns: int = 7  # live-stream turns
    window: int = 3  # segments the stream keeps

    def seeds(self) -> list[tuple[int, int]]:
        """(seed, segment) of every part the video workloads send (for ``VideoParts``, before anything is timed)."""
        out = [(SEEDS["video_warmup"], 0)]
        out += [(SEEDS["video_cached"] + 100 * i + j, 0) for i, n in enumerate(self.ns) for j in range(n)]
        out += [(SEEDS["video_new"] + r, 0) for r in range(self.new_repeats)]
        return out + [(SEEDS["video_stream"], t) for t in range(self.turns)]


@dataclasses.dataclass(frozen=True)
class LoadPlan:
    rates: tuple[float, ...]  # requests/s offered, increasing: the SLO ladder stops at the first rate failed
    conversations: int  # at the lowest rates; more at the higher ones (``conversations_at``)
    turns: int
    max_tokens: int
    # Each rate offers at least this many seconds of arrivals: 24 requests at 8/s would be a 3 s transient, not a
    # load, so the higher rates get more conversations (more users, each turn still waiting for its answer).
    min_schedule_s: float = 0.0
    budget_s: float = float("inf")  # the ladder takes no further rate once this much time went into it
    # Offered, highest first, only when the ladder's first rate fails: a limit below the ladder is named too, and
    # the engine gets a throughput at the SLO instead of none.
    below: tuple[float, ...] = ()

    @property
    def all_rates(self) -> tuple[float, ...]:
        """The ladder's rates, then the ones below it: a rate's index here picks its seeds (``load``)."""
        return self.rates + self.below

    def conversations_at(self, rate: float) -> int:
        return max(self.conversations, math.ceil(rate * self.min_schedule_s / self.turns))


def _row(reply: Reply, **extra) -> dict:
    return {"ttft_ms": reply.ttft_ms, "e2e_ms": reply.e2e_ms, "prompt_tokens": reply.prompt_tokens,
            "cached_tokens": reply.cached_tokens, "completion_tokens": reply.completion_tokens,
            "tpot_ms": reply.tpot_ms, **extra}  # fmt: skip


def _slope(rows: list[dict], x: str = "n") -> dict | None:
    try:
        return stats.fit_slope([r[x] for r in rows], [r["ttft_ms"] for r in rows]).as_dict()
    except ValueError:
        return None


def _by_n(rows: list[dict]) -> dict[int, float]:
    return {n: stats.median([r["ttft_ms"] for r in rows if r["n"] == n]) for n in sorted({r["n"] for r in rows})}


async def warmup(client: Client, parts: Parts) -> None:
    """Untimed: first requests pay one-off costs on both engines (lazy initialisation, weight packing, caches)."""
    base = SEEDS["warmup"]
    await client.chat([user([parts(base)], question(0))], 4)
    await client.chat([user([parts(base + i) for i in range(1, 5)], question(1))], 4)
    await client.chat([user([parts(base + 1)], question(2))], 4)


async def _probed(client: Client, messages: list[dict], max_tokens: int, probe, stages: dict, n: int) -> Reply:
    """One request with the scheduler's stage histogram read before and after it (``peer_stages``; probe None:
    vLLM, nothing read). The reads are between requests, outside the timed span."""
    before = probe.snapshot() if probe else None
    reply = await client.chat(messages, max_tokens)
    if probe:
        peer_stages.add(stages.setdefault(n, peer_stages.new_accumulator()), before, probe.snapshot())
    return reply


async def cached(client: Client, parts: Parts, ns, repeats: int, max_tokens: int, texts: dict, probe=None) -> dict:
    rows, stages = [], {}
    for i, n in enumerate(ns):
        imgs = [parts(SEEDS["cached"] + 100 * i + j) for j in range(n)]
        first = user(imgs, "Describe the pictures.")
        await client.chat([first, assistant(), user([], question(0))], max_tokens)  # fills the cache
        for r in range(repeats):
            reply = await _probed(client, [first, assistant(), user([], question(r + 1))], max_tokens, probe, stages, n)
            rows.append(_row(reply, n=n, repeat=r))
            texts[f"cached/n{n}/r{r}"] = reply.text
    return {"rows": rows, "ttft_p50_by_n": _by_n(rows), "slope": _slope(rows), "stages": stages}


async def new_images(
    client: Client, parts: Parts, sizes, ns, repeats: int, max_tokens: int, texts: dict, probe=None
) -> dict:
    out = {}
    seed = SEEDS["new"]
    for size in sizes:
        rows, stages = [], {}
        label = f"{size[0]}x{size[1]}"
        for r in range(repeats):
            for n in ns:
                imgs = [parts(seed + j, size) for j in range(n)]
                seed += n
                reply = await _probed(client, [user(imgs, question(r))], max_tokens, probe, stages, n)
                rows.append(_row(reply, n=n, repeat=r))
                texts[f"new/{label}/n{n}/r{r}"] = reply.text
        out[label] = {"rows": rows, "ttft_p50_by_n": _by_n(rows), "slope": _slope(rows), "stages": stages}
    return out


async def load(client: Client, parts: Parts, plan: LoadPlan, rate_index: int, texts: dict) -> dict:
    rate = plan.all_rates[rate_index]
    conversations = plan.conversations_at(rate)
    total = conversations * plan.turns
    rng = random.Random(1234 + rate_index)  # the same schedule on every engine
    arrivals, t = [], 0.0
    for _ in range(total):
        t += rng.expovariate(rate)
        arrivals.append(t)
    histories: list[list[dict]] = [[] for _ in range(conversations)]
    seed0 = SEEDS["load"] + 1000 * rate_index
    start = time.monotonic() + 0.05

    async def one(k: int, at: float, previous: asyncio.Task | None) -> dict:
        c, turn = k % conversations, k // conversations
        await asyncio.sleep(max(0.0, start + at - time.monotonic()))
        if previous is not None:
            await previous  # a chat user asks the next question after the answer
        messages = histories[c] + [user([parts(seed0 + k)], question(turn))]
        sent = time.monotonic()
        try:
            reply = await client.chat(messages, plan.max_tokens)
        except Exception as e:  # noqa: BLE001 — a failed request is a figure of the run, not its end
            return {"k": k, "failed": f"{type(e).__name__}: {e}"[:300]}
        finally:
            histories[c] = messages + [assistant()]
        texts[f"load/{rate:g}/k{k}"] = reply.text
        return _row(
            reply,
            k=k,
            conversation=c,
            turn=turn,
            at_s=at,
            wait_ms=(sent - start - at) * 1e3,
            end_s=sent + reply.e2e_ms / 1e3 - start,
            itl_ms=reply.itl_ms,
        )

    tasks: list[asyncio.Task] = []
    last: list[asyncio.Task | None] = [None] * conversations
    for k, at in enumerate(arrivals):
        task = asyncio.create_task(one(k, at, last[k % conversations]))
        last[k % conversations] = task
        tasks.append(task)
    rows = await asyncio.gather(*tasks)
    ok = [r for r in rows if "failed" not in r]
    return {
        "rate": rate,
        "offered": total,
        "conversations": conversations,
        **summarise_load(ok, len(rows) - len(ok)),
        "failures": [r for r in rows if "failed" in r][:5],
        "rows": ok,
    }


def summarise_load(rows: list[dict], failed: int) -> dict:
    if not rows:
        return {"completed": 0, "failed": failed}
    duration = max(r["end_s"] for r in rows)  # from the schedule's start to the last token
    ttft = [r["ttft_ms"] for r in rows]
    tpot = [r["tpot_ms"] for r in rows if r["tpot_ms"] is not None]
    itl = [x for r in rows for x in r["itl_ms"]]
    waits = [max(0.0, r["wait_ms"]) for r in rows]
    return {
        "completed": len(rows), "failed": failed, "duration_s": duration,
        "ttft_p50_ms": stats.percentile(ttft, 50), "ttft_p99_ms": stats.percentile(ttft, 99),
        "tpot_p50_ms": stats.percentile(tpot, 50) if tpot else None,
        "tpot_mean_ms": sum(tpot) / len(tpot) if tpot else None,
        "itl_p50_ms": stats.percentile(itl, 50) if itl else None,
        "itl_p99_ms": stats.percentile(itl, 99) if itl else None,
        "request_throughput": len(rows) / duration,
        "output_token_throughput": sum(r["completion_tokens"] for r in rows) / duration,
        "conversation_wait_p99_ms": stats.percentile(waits, 99),
    }  # fmt: skip


async def sliding(
    client: Client, parts: Parts, turns: int, window: int, max_tokens: int, texts: dict, probe=None
) -> dict:
    """A conversation keeping its last ``window`` turns, one new image each; the turns after the window fills
    (every token prefilled again, one image new) also read the stage histogram (``probe``: mmcast only)."""
    kept: list[list[dict]] = []  # one [user, assistant] pair per turn still in the window
    rows, stages = [], {}
    for t in range(turns):
        turn = user([parts(SEEDS["sliding"] + t)], question(t))
        kept = kept[-(window - 1) :] if window > 1 else []
        messages = [m for pair in kept for m in pair] + [turn]
        if t + 1 > window:
            reply = await _probed(client, messages, max_tokens, probe, stages, window)
        else:
            reply = await client.chat(messages, max_tokens)
        rows.append(_row(reply, turn=t + 1, images=len(kept) + 1))
        texts[f"sliding/t{t}"] = reply.text
        kept.append([turn, assistant()])
    slid = [r["ttft_ms"] for r in rows if r["turn"] > window]
    return {"window": window, "rows": rows, "stages": stages,
            "ttft_mean_after_window_ms": sum(slid) / len(slid) if slid else None,
            "ttft_mean_ms": sum(r["ttft_ms"] for r in rows) / len(rows)}  # fmt: skip


async def video(client: Client, parts: VideoParts, plan: VideoPlan, max_tokens: int, texts: dict) -> dict:
    """The three video workloads in turn (the module docstring): cached clips, a new clip, the live stream."""
    body = video_body()

    async def chat(messages, key):
        reply = await client.chat(messages, max_tokens, extra=body)
        texts[key] = reply.text
        return reply

    # untimed: the first video request pays the engines' one-off video costs (decoder libraries, kernels)
    await client.chat([user([parts(SEEDS["video_warmup"])], question(0))], 4, extra=body)
    rows = []
    for i, n in enumerate(plan.ns):
        first = user([parts(SEEDS["video_cached"] + 100 * i + j) for j in range(n)], "Describe the clips.")
        await client.chat([first, assistant(), user([], question(0))], max_tokens, extra=body)  # fills the cache
        for r in range(plan.repeats):
            key = f"video/cached/n{n}/r{r}"
            reply = await chat([first, assistant(), user([], question(r + 1))], key)
            rows.append(_row(reply, key=key, n=n, repeat=r))
    cached = {"rows": rows, "ttft_p50_by_n": _by_n(rows), "slope": _slope(rows)}
    rows = []
    for r in range(plan.new_repeats):
        key = f"video/new/r{r}"
        reply = await chat([user([parts(SEEDS["video_new"] + r)], question(r))], key)
        rows.append(_row(reply, key=key, repeat=r))
    new = {"rows": rows, "ttft_p50_ms": stats.median([x["ttft_ms"] for x in rows]) if rows else None}
    rows = []
    for t in range(plan.turns):
        kept = [parts(SEEDS["video_stream"], k) for k in range(max(0, t - plan.window + 1), t + 1)]
        key = f"video/stream/t{t}"
        reply = await chat([user(kept, question(t))], key)
        rows.append(_row(reply, key=key, turn=t + 1, segments=len(kept)))
    after = [x["ttft_ms"] for x in rows if x["turn"] > plan.window]
    stream = {"window": plan.window, "rows": rows,
              "ttft_p50_after_window_ms": stats.median(after) if after else None,
              "ttft_mean_after_window_ms": sum(after) / len(after) if after else None}  # fmt: skip
    return {"clips": VideoParts.LABEL, "body": body, "cached": cached, "new": new, "stream": stream}
