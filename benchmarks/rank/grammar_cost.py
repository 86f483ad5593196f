"""What a constrained request costs the requests batched beside it: ``python -m benchmarks.rank.grammar_cost [--out DIR]``;
also part of ``benchmarks.run`` (quick and smoke plans).

One fresh local group (TP1, the defaults). A greedy unconstrained probe (``ignore_eos``, a fixed number of tokens)
streams through the ``openai`` package in three settings, interleaved round by round so the machine's load of the
moment falls on all of them:

- ``alone``: the probe by itself (one request per decode step);
- ``beside_free``: the probe while an unconstrained sampled request decodes in the same steps;
- ``beside_constrained``: the probe while a request under a grammar (``guided_regex``, a mask every step: the
  scheduler's matcher advances and computes it, the rank applies it) decodes in the same steps.

A step's cost is measured twice:

- on the server: the probe's time per output token as the engine delivered them (its ``request finished`` log line:
  total less time to first token, over the tokens after the first), the decode step as the group pays it;
- on the client: the probe's median gap between streamed tokens. The client shares the machine's CPUs and its
  event loop also parses the companion's stream, so this one also grows with the companion's output: a regex of
  letters yields a text chunk every token, while the free companion's random tokens often end inside a character,
  whose bytes the server holds back (fewer chunks). The companion's chunks per probe token are reported beside it.

Reported per measure: ``beside_constrained / alone`` (the target, <= 1.2x) and ``beside_constrained / beside_free``
(the grammar's own share, without the second row of the batch), and per setting the steps the scheduler planned
ahead (``mmcast_steps_planned_ahead_total``; under async scheduling a constrained request's steps are planned ahead
too, its masks following the control). The probe's text must be the same in every setting (greedy: the batch changes
no token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request

SETTINGS = ("alone", "beside_free", "beside_constrained")
TARGET = 1.2  # beside_constrained / alone
COMPANION_REGEX = "[a-z]{400}"  # far longer than the probe: a mask every step of the probe's decode


async def _probe(client, model: str, tokens: int, request_id: str = "") -> tuple[list[float], str]:
    """Gaps (ms) between the probe's streamed tokens after the first, and its text. ``request_id``: its
    x-request-id, to find its line in the scheduler's log."""
    stamps, parts = [], []
    stream = await client.chat.completions.create(
        extra_headers={"x-request-id": request_id} if request_id else None,
        model=model,
        messages=[{"role": "user", "content": "Count the stars."}],
        max_tokens=tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    return [1000 * (b - a) for a, b in zip(stamps, stamps[1:], strict=False)], "".join(parts)


async def _companion(client, model: str, constrained: bool, started: asyncio.Event, chunks: list[int]) -> None:
    """Decodes beside the probe; ``chunks[0]`` counts its content chunks."""
    extra = {"guided_regex": COMPANION_REGEX} if constrained else {"ignore_eos": True}
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write letters."}],
        max_tokens=450,
        temperature=1.0,
        seed=1,
        stream=True,
        extra_body=extra,
    )
    try:
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                chunks[0] += 1
                started.set()  # decoding: the probe now shares its steps
    finally:
        await stream.close()


def _planned_ahead(metrics_url: str) -> float:
    """The scheduler's ``mmcast_steps_planned_ahead_total``."""
    with urllib.request.urlopen(metrics_url, timeout=10) as reply:  # noqa: S310 - the loopback group we started
        for line in reply.read().decode().splitlines():
            if line.startswith("mmcast_steps_planned_ahead_total "):
                return float(line.split()[1])
    return 0.0


async def _round(client, model: str, setting: str, tokens: int, request_id: str) -> tuple[list[float], str, float]:
    """The probe's gaps and text, and the companion's content chunks per probe token while the probe ran."""
    if setting == "alone":
        return (*await _probe(client, model, tokens, request_id), 0.0)
    started, chunks = asyncio.Event(), [0]
    companion = asyncio.create_task(_companion(client, model, setting == "beside_constrained", started, chunks))
    await started.wait()
    try:
        before = chunks[0]
        gaps, text = await _probe(client, model, tokens, request_id)
        return gaps, text, (chunks[0] - before) / tokens
    finally:
        companion.cancel()
        await asyncio.gather(companion, return_exceptions=True)


def _server_token_ms(log_path, request_ids: dict[str, str], timeout: float = 10.0) -> dict[str, float]:
    """request id -> the probe's ms per output token after the first, from the scheduler's ``request finished``
    lines (the engine's request id is the x-request-id the probe sent, scoped by a tenant prefix when there is one)."""
    deadline = time.monotonic() + timeout
    while True:
        found = {}
        with open(log_path) as f:
            for line in f:
                if '"request finished"' not in line:
                    continue
                rec = json.loads(line)
                rid = next((r for r in request_ids if str(rec.get("request_id", "")).endswith(r)), None)
                ttft, n = rec.get("time_to_first_token_seconds"), rec.get("completion_tokens", 0)
                if rid is not None and ttft is not None and n > 1:
                    found[rid] = 1000 * (rec["total_seconds"] - ttft) / (n - 1)
        if len(found) == len(request_ids) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def measure(model_dir: str, *, tokens: int = 48, rounds: int = 6, log=print, scheduler_args=(), worker_args=()) -> dict:
    """Runs the three settings ``rounds`` times each in a fresh group; returns per-setting medians and the ratios.
    ``scheduler_args``: extra scheduler flags (``--async-grammar false``: constrained steps wait, for comparison);
    ``worker_args``: extra rank flags (``--inline-step-max-ms 0``: every step on the compute thread)."""
    import openai

    from mmcast_local.supervisor import LocalGroup

    gaps: dict[str, list[float]] = {s: [] for s in SETTINGS}
    texts: dict[str, set[str]] = {s: set() for s in SETTINGS}
    ahead: dict[str, float] = {s: 0.0 for s in SETTINGS}
    companion_chunks: dict[str, list[float]] = {s: [] for s in SETTINGS}
    probes: dict[str, str] = {}  # x-request-id -> setting
    load_before = os.getloadavg()[0]
    with LocalGroup(model_dir, tp=1, scheduler_args=list(scheduler_args), worker_args=list(worker_args)) as group:

        async def main() -> None:
            async with openai.AsyncOpenAI(base_url=group.openai_base_url, api_key="unused", timeout=300) as client:
                model = (await client.models.list()).data[0].id
                await _probe(client, model, 4)  # warm: compile paths, caches
                for r in range(rounds):
                    for setting in SETTINGS[r % 3 :] + SETTINGS[: r % 3]:  # rotate the order each round
                        before = await asyncio.to_thread(_planned_ahead, group.metrics_urls["scheduler"])
                        request_id = f"grammar-cost-{setting}-{r}"
                        probes[request_id] = setting
                        got, text, per_token = await _round(client, model, setting, tokens, request_id)
                        companion_chunks[setting].append(per_token)
                        ahead[setting] += (
                            await asyncio.to_thread(_planned_ahead, group.metrics_urls["scheduler"]) - before
                        )
                        gaps[setting].extend(got)
                        texts[setting].add(text)

        asyncio.run(main())
        server = _server_token_ms(group.log_dir / "scheduler.log", probes)
    medians = {s: statistics.median(g) for s, g in gaps.items()}
    by_setting = {s: [ms for rid, ms in server.items() if probes[rid] == s] for s in SETTINGS}
    server_ms = {s: statistics.median(v) if v else None for s, v in by_setting.items()}
    have_server = all(v is not None for v in server_ms.values())
    same_text = len(set().union(*texts.values())) == 1
    result = {
        "tokens": tokens,
        "rounds": rounds,
        "step_ms": medians,
        "ratio": medians["beside_constrained"] / medians["alone"],
        "ratio_vs_free": medians["beside_constrained"] / medians["beside_free"],
        "server_step_ms": server_ms,  # the probe's ms per token after the first, as the engine delivered them
        "server_ratio": server_ms["beside_constrained"] / server_ms["alone"] if have_server else None,
        "server_ratio_vs_free": server_ms["beside_constrained"] / server_ms["beside_free"] if have_server else None,
        "companion_chunks_per_token": {s: statistics.median(v) for s, v in companion_chunks.items() if v},
        "target": TARGET,
        "same_text": same_text,
        "planned_ahead": {s: int(v) for s, v in ahead.items()},  # steps planned ahead while each setting ran
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    log(write(None, result))
    return result


def write(out_dir: str | None, result: dict) -> str:
    """The markdown table (also written to ``grammar_cost.md`` under ``out_dir``)."""
    m, srv = result["step_ms"], result.get("server_step_ms") or {}
    chunks = result.get("companion_chunks_per_token") or {}

    def ms(x) -> str:
        return "–" if x is None else f"{x:.2f}"

    def verdict(ratio) -> str:
        if ratio is None:
            return "–"
        return f"**{ratio:.2f}x** ({'met' if ratio <= result['target'] else 'not met'})"

    md = "\n".join(
        [
            "## Structured output: a constrained request beside an unconstrained one, per decode step",
            "",
            "| setting | server: ms per token (median) | client: median gap (ms) | companion chunks per probe token |",
            "|---|---:|---:|---:|",
            *(
                f"| {s} | {ms(srv.get(s))} | {m[s]:.2f} | {ms(chunks.get(s)) if s != 'alone' else '–'} |"
                for s in SETTINGS
            ),  # fmt: skip
            "",
            f"beside_constrained / alone (target <= {result['target']}x): server {verdict(result.get('server_ratio'))}, "
            f"client {verdict(result['ratio'])}; beside_constrained / beside_free (the grammar's own share): server "
            f"{ms(result.get('server_ratio_vs_free'))}x, client {result['ratio_vs_free']:.2f}x. "
            f"Probe text equal in every setting: {result['same_text']}. Steps planned ahead (async scheduling) "
            f"while each setting ran, over its {result['rounds']} rounds: "
            + ", ".join(f"{s} {n}" for s, n in result.get("planned_ahead", {}).items())
            + f". Load average (1 min) before/after: {result['loadavg_1m']}.",
            "",
        ]
    )
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "grammar_cost.md"), "w") as f:
            f.write(md)
    return md


def main(argv: list[str] | None = None) -> int:
    from common.tiny_model import ensure_tiny_model

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rank.grammar_cost", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", help="folder for grammar_cost.md")
    parser.add_argument("--model-dir", help="tiny model folder (built if missing)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--scheduler-args", default="", help='extra scheduler flags, e.g. "--async-grammar false"')
    parser.add_argument("--worker-args", default="", help='extra rank flags, e.g. "--inline-step-max-ms 0"')
    args = parser.parse_args(argv)
    model_dir = str(ensure_tiny_model(args.model_dir or os.path.join("benchmarks", "results", ".model", "qwen2_vl")))
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    result = measure(
        model_dir,
        rounds=args.rounds,
        log=log,
        scheduler_args=args.scheduler_args.split(),
        worker_args=args.worker_args.split(),
    )
    write(args.out, result)
    return 0 if result["same_text"] else 1


if __name__ == "__main__":
    sys.exit(main())
