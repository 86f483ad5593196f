"""What a constrained request costs the requests batched beside it: ``python -m benchmarks.rank.grammar_cost [--out DIR]``;
also part of ``benchmarks.run`` (quick and smoke plans).

One fresh local group (TP1, the defaults). A greedy unconstrained probe (``ignore_eos``, a fixed number of tokens)
streams through the ``openai`` package in three settings, interleaved round by round so the machine's load of the
moment falls on all of them:

- ``alone``: the probe by itself (one request per decode step);
- ``beside_free``: the probe while an unconstrained sampled request decodes in the same steps;
- ``beside_constrained``: the probe while a request under a grammar (``guided_regex``, a mask every step: the
  scheduler's matcher advances and computes it, the rank applies it) decodes in the same steps.

A step's cost is the probe's median gap between streamed tokens (client side). Reported: ``beside_constrained /
alone`` (the target, <= 1.2x) and ``beside_constrained / beside_free`` (the grammar's own share, without the second
row of the batch), and per setting the steps the scheduler planned ahead (``mmcast_steps_planned_ahead_total``; under
async scheduling a constrained request's steps are planned ahead too, its masks following the control). The probe's
text must be the same in every setting (greedy: the batch changes no token).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
import urllib.request

SETTINGS = ("alone", "beside_free", "beside_constrained")
TARGET = 1.2  # beside_constrained / alone
COMPANION_REGEX = "[a-z]{400}"  # far longer than the probe: a mask every step of the probe's decode


async def _probe(client, model: str, tokens: int) -> tuple[list[float], str]:
    """Gaps (ms) between the probe's streamed tokens after the first, and its text."""
    stamps, parts = [], []
    stream = await client.chat.completions.create(
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


async def _companion(client, model: str, constrained: bool, started: asyncio.Event) -> None:
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


async def _round(client, model: str, setting: str, tokens: int) -> tuple[list[float], str]:
    if setting == "alone":
        return await _probe(client, model, tokens)
    started = asyncio.Event()
    companion = asyncio.create_task(_companion(client, model, setting == "beside_constrained", started))
    await started.wait()
    try:
        return await _probe(client, model, tokens)
    finally:
        companion.cancel()
        await asyncio.gather(companion, return_exceptions=True)


def measure(model_dir: str, *, tokens: int = 48, rounds: int = 6, log=print, scheduler_args=()) -> dict:
    """Runs the three settings ``rounds`` times each in a fresh group; returns per-setting medians and the ratios.
    ``scheduler_args``: extra scheduler flags (``--async-grammar false``: constrained steps wait, for comparison)."""
    import openai

    from mmcast_local.supervisor import LocalGroup

    gaps: dict[str, list[float]] = {s: [] for s in SETTINGS}
    texts: dict[str, set[str]] = {s: set() for s in SETTINGS}
    ahead: dict[str, float] = {s: 0.0 for s in SETTINGS}
    load_before = os.getloadavg()[0]
    with LocalGroup(model_dir, tp=1, scheduler_args=list(scheduler_args)) as group:

        async def main() -> None:
            async with openai.AsyncOpenAI(base_url=group.openai_base_url, api_key="unused", timeout=300) as client:
                model = (await client.models.list()).data[0].id
                await _probe(client, model, 4)  # warm: compile paths, caches
                for r in range(rounds):
                    for setting in SETTINGS[r % 3 :] + SETTINGS[: r % 3]:  # rotate the order each round
                        before = await asyncio.to_thread(_planned_ahead, group.metrics_urls["scheduler"])
                        got, text = await _round(client, model, setting, tokens)
                        ahead[setting] += (
                            await asyncio.to_thread(_planned_ahead, group.metrics_urls["scheduler"]) - before
                        )
                        gaps[setting].extend(got)
                        texts[setting].add(text)

        asyncio.run(main())
    medians = {s: statistics.median(g) for s, g in gaps.items()}
    same_text = len(set().union(*texts.values())) == 1
    result = {
        "tokens": tokens,
        "rounds": rounds,
        "step_ms": medians,
        "ratio": medians["beside_constrained"] / medians["alone"],
        "ratio_vs_free": medians["beside_constrained"] / medians["beside_free"],
        "target": TARGET,
        "same_text": same_text,
        "planned_ahead": {s: int(v) for s, v in ahead.items()},  # steps planned ahead while each setting ran
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    log(write(None, result))
    return result


def write(out_dir: str | None, result: dict) -> str:
    """The markdown table (also written to ``grammar_cost.md`` under ``out_dir``)."""
    m = result["step_ms"]
    status = "met" if result["ratio"] <= result["target"] else "not met"
    md = "\n".join(
        [
            "## Structured output: a constrained request beside an unconstrained one, per decode step",
            "",
            "| setting | median step (ms) |",
            "|---|---|",
            *(f"| {s} | {m[s]:.2f} |" for s in SETTINGS),
            "",
            f"beside_constrained / alone = **{result['ratio']:.2f}x** (target <= {result['target']}x: {status}); "
            f"beside_constrained / beside_free = {result['ratio_vs_free']:.2f}x (the grammar's own share). "
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
    args = parser.parse_args(argv)
    model_dir = str(ensure_tiny_model(args.model_dir or os.path.join("benchmarks", "results", ".model", "qwen2_vl")))
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    result = measure(model_dir, rounds=args.rounds, log=log, scheduler_args=args.scheduler_args.split())
    write(args.out, result)
    return 0 if result["same_text"] else 1


if __name__ == "__main__":
    sys.exit(main())
