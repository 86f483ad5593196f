"""The decode step at low load, split into the scheduler's share and the rank's:
``python -m benchmarks.transfer.step_overlap [--variant NAME=ARGS ...] [--baseline-tree DIR] [--rounds N]``.

One fresh local group (TP1, the tiny default model) per variant, all started up front and driven in interleaved
rounds (the order rotates each round) so the machine's load of the moment falls on every variant. A round streams
``streams`` concurrent greedy ``ignore_eos`` requests of ``tokens`` tokens each through the ``openai`` package, for
1 and 4 streams. The client runs at niceness 10 (``--client-nice``) once the groups are up: on a machine of few
CPUs the servers get them first, as they would with the clients elsewhere. Per variant and concurrency:

- ``step_ms``: the server's inter-token latency (``mmcast_inter_token_latency_seconds``, mean): the decode step,
  taken where the tokens are handed to the client streams, so a client that reads them late does not blur it;
- ``tpot_ms``: the client's time per output token, ``(last token - first token) / (tokens - 1)`` per stream, median;
- ``rank_ms``: the rank's own step time (``mmcast_worker_step_seconds``: control received → answer sent), mean;
  under ``--async-scheduling`` a step planned ahead arrives while the previous one computes, so its time includes
  that wait and ``scheduler_ms`` turns negative: compare ``step_ms`` there;
- ``schedule_ms``: the core's ``schedule()`` (``mmcast_schedule_seconds``), mean;
- ``scheduler_ms``: ``step_ms - rank_ms``: the share of a step the rank waits for the scheduler (with the
  scheduler's work overlapped with the rank's, it falls toward the transport alone).

A variant is ``NAME=flags`` (scheduler flags, shell words); ``--baseline-tree DIR`` adds a variant ``baseline``
whose processes import mmcast from another checkout (``PYTHONPATH=DIR``), so one run compares a change against the
tree it started from. Ratios are each variant's ``step_ms`` over the first variant's. Every variant's text must be
the same (greedy): a difference fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time
import urllib.request

CONCURRENCY = (1, 4)
_METRICS = {
    "itl": ("scheduler", "mmcast_inter_token_latency_seconds"),
    "schedule": ("scheduler", "mmcast_schedule_seconds"),
    "step": ("scheduler", "mmcast_step_seconds"),
    "rank": ("rank0", "mmcast_worker_step_seconds"),
}


def _scrape(urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    """(sum, count) of each histogram in ``_METRICS``."""
    pages = {name: urllib.request.urlopen(url, timeout=10).read().decode() for name, url in urls.items()}
    out = {}
    for key, (proc, metric) in _METRICS.items():
        total = count = 0.0
        for line in pages[proc].splitlines():
            if line.startswith(metric + "_sum"):
                total = float(line.rsplit(" ", 1)[1])
            elif line.startswith(metric + "_count"):
                count = float(line.rsplit(" ", 1)[1])
        out[key] = (total, count)
    return out


async def _stream(client, model: str, tokens: int, k: int) -> tuple[list[float], str]:
    stamps, parts = [], []
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Count the stars, {k}."}],
        max_tokens=tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
            parts.append(chunk.choices[0].delta.content)
    return [1000 * (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)], "".join(parts)


async def _round(client, model: str, streams: int, tokens: int) -> tuple[list[float], list[str]]:
    got = await asyncio.gather(*(_stream(client, model, tokens, k) for k in range(streams)))
    return [g for gaps, _ in got for g in gaps], [text for _, text in got]


def _variants(specs: list[str], baseline_tree: str | None) -> dict[str, tuple[list[str], dict[str, str] | None]]:
    out: dict[str, tuple[list[str], dict[str, str] | None]] = {}
    if baseline_tree:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(baseline_tree))
        out["baseline"] = ([], env)
    for spec in specs or ["default="]:
        name, _, args = spec.partition("=")
        out[name] = (shlex.split(args), None)
    return out


def measure(
    model_dir: str, variants: dict, *, tokens: int = 64, rounds: int = 4, client_nice: int = 10, log=print
) -> dict:
    import openai

    from mmcast_local.supervisor import LocalGroup

    names = list(variants)
    rows = {(v, c): {"gaps": [], "deltas": []} for v in names for c in CONCURRENCY}
    texts: dict[tuple[str, int], set[tuple[str, ...]]] = {(v, c): set() for v in names for c in CONCURRENCY}
    groups = {v: LocalGroup(model_dir, tp=1, scheduler_args=a, env=e) for v, (a, e) in variants.items()}
    try:
        for g in groups.values():
            g.start()
        for g in groups.values():
            g.wait_ready()
        if client_nice:  # after the groups start (they inherit it): the servers get the CPUs first
            os.nice(client_nice)

        async def main() -> None:
            clients = {v: openai.AsyncOpenAI(base_url=g.openai_base_url, api_key="unused", timeout=300)
                       for v, g in groups.items()}  # fmt: skip
            models = {v: (await c.models.list()).data[0].id for v, c in clients.items()}
            for v in names:
                await _round(clients[v], models[v], 4, 8)  # warm
            for r in range(rounds):
                for v in names[r % len(names) :] + names[: r % len(names)]:
                    for c in CONCURRENCY:
                        before = _scrape(groups[v].metrics_urls)
                        gaps, got = await _round(clients[v], models[v], c, tokens)
                        after = _scrape(groups[v].metrics_urls)
                        rows[v, c]["gaps"].extend(gaps)
                        rows[v, c]["deltas"].append({k: (after[k][0] - before[k][0], after[k][1] - before[k][1])
                                                     for k in after})  # fmt: skip
                        texts[v, c].add(tuple(got))
            for client in clients.values():
                await client.close()

        asyncio.run(main())
    finally:
        for g in groups.values():
            g.stop()
    result: dict = {"tokens": tokens, "rounds": rounds, "variants": names, "rows": []}
    first = {}
    for v in names:
        for c in CONCURRENCY:
            row = rows[v, c]

            def mean_ms(key: str, row=row) -> float:
                total = sum(d[key][0] for d in row["deltas"])
                count = sum(d[key][1] for d in row["deltas"])
                return 1000 * total / count if count else float("nan")

            step = mean_ms("itl")
            rank = mean_ms("rank")
            entry = {"variant": v, "streams": c, "step_ms": step, "tpot_ms": statistics.median(row["gaps"]),
                     "rank_ms": rank, "schedule_ms": mean_ms("schedule"),
                     "scheduler_ms": step - rank, "loop_step_ms": mean_ms("step")}  # fmt: skip
            first.setdefault(c, step)
            entry["ratio"] = step / first[c]
            result["rows"].append(entry)
    result["same_text"] = all(len({t for v in names for t in texts[v, c]}) == 1 for c in CONCURRENCY)
    log(write(None, result))
    return result


def write(out_dir: str | None, result: dict) -> str:
    """The markdown table (also written to ``step_overlap.md`` under ``out_dir``)."""
    lines = [
        "## Decode step at low load: the scheduler's share and the rank's (TP1, medians / means in ms)",
        "",
        "| variant | streams | step (server ITL) | client TPOT | rank | scheduler (step - rank) | schedule() | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for e in result["rows"]:
        lines.append(f"| {e['variant']} | {e['streams']} | {e['step_ms']:.2f} | {e['tpot_ms']:.2f} | {e['rank_ms']:.2f} | "
                     f"{e['scheduler_ms']:.2f} | {e['schedule_ms']:.3f} | {e['ratio']:.2f}x |")  # fmt: skip
    lines += ["", f"Text equal across variants: {result['same_text']}.", ""]
    md = "\n".join(lines)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "step_overlap.md"), "w") as f:
            f.write(md)
    return md


def main(argv: list[str] | None = None) -> int:
    from common.tiny_model import ensure_tiny_model

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transfer.step_overlap", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--variant", action="append", default=[], help="NAME=scheduler flags (repeatable)")
    parser.add_argument("--baseline-tree", help="a checkout to run as the variant 'baseline' (PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--client-nice", type=int, default=10, help="niceness of the client (0: as the servers)")
    parser.add_argument("--out", help="folder for step_overlap.md")
    parser.add_argument("--model-dir", help="tiny model folder (built if missing)")
    args = parser.parse_args(argv)
    model_dir = str(ensure_tiny_model(args.model_dir or os.path.join("benchmarks", "results", ".model", "qwen2_vl")))
    variants = _variants(args.variant, args.baseline_tree)
    result = measure(
        model_dir, variants, tokens=args.tokens, rounds=args.rounds, client_nice=args.client_nice, log=print
    )
    write(args.out, result)
    return 0 if result["same_text"] else 1


if __name__ == "__main__":
    sys.exit(main())
