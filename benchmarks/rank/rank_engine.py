"""The rank's language model against transformers' static batch: ``python -m benchmarks.rank.rank_engine [--quick]
[--widths 2b,2b-vocab1k,7b,qwen3-2b] [--out DIR]`` (``make bench``: every width; ``make bench-quick``: the short
2B-width form).

Checkpoints: 2-layer Qwen2-VL with real widths and random weights, float32 — Qwen2-VL-2B's widths
(``common.tiny_model``, ``width="real"``) and Qwen2-VL-7B's (hidden 3584, 28 query / 4 KV heads, intermediate 18944,
vocabulary 152064, untied ``lm_head``; built here), each built once under ``benchmarks/results/.model``. Beside them
``2b-vocab1k``: Qwen2-VL-2B's widths with the tokenizer's 1,024-token vocabulary (built here), whose decode step is
the decoder's layers without the 151,936-row ``lm_head`` that is most of the 2B checkpoint's step. ``qwen3-2b``: a
2-layer Qwen3-VL at Qwen3-VL-2B's widths (``common.tiny_model``, ``QWEN3_REAL_WIDTH``: head_dim 128,
16 query / 8 KV heads, interleaved M-RoPE), the same jobs through the same rank code (its DeepStack inputs are absent
from text requests, so the figures compare the decoders).

Jobs: N = 1, 4, 16, 32 concurrent text requests with equal (~1k tokens) or mixed prompt lengths (256, 512, 1k, 2k,
4k in turn), every prompt distinct from its first block on (no prefix-cache hit), greedy, ``ignore_eos``, the same
number of new tokens each. Served: one local group (TP 1, real processes), all N requests of a job sent at once
through the SDK with token streaming, twice: the first pass gives the prefill figures and the tokens, the second
(the same prompts, now prefix-cached, so every request reaches its first token at once and the N decode together
as the static batch's do) the decode figures (``rank_engine_served``). Reference: one process with plain transformers, the same prompt token ids
left-padded into one batch, ``generate`` with the same new tokens. The two sides take turns job by job (never at
the same time), so a machine whose load drifts weighs on both alike; the rank gets every CPU, as the transformers
process does (``MMCAST_RESERVED_CPUS=0``; serve-local's default leaves one to the scheduler).

Figures per job, both sides: prefill tokens/s (real prompt tokens over the time until every request has its first
token) and decode tokens/s (tokens produced after the last first token, over that phase: pure decode steps on both
sides), and end to end (every new token over the whole job). Beside the served figures, the rank's own step time
over the decode phase (``mmcast_worker_step_seconds`` from its ``/metrics``). A third table divides a decode step's time by the tokens its 16 requests attend to
(context lengths summed) at 256, 1k and 4k tokens of context. Greedy tokens are compared; a random-weight model's
near-ties can flip a token between a padded batch and a ragged one, so equality is reported, not required.

Beside this module, by role: ``rank_engine_jobs`` (the plans and prompts), ``rank_engine_models`` (the checkpoints),
``rank_engine_served`` (the group's side), ``rank_engine_reference`` (the transformers process), ``rank_engine_report``
(rates, tables, plot, files).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.rank.rank_engine_jobs import PLANS, Plan, prompts
from benchmarks.rank.rank_engine_models import model_dir
from benchmarks.rank.rank_engine_reference import reference_main
from benchmarks.rank.rank_engine_report import tables, write
from benchmarks.rank.rank_engine_served import run_jobs


def measure(plans, log=print, env: dict | None = None, worker_args: tuple[str, ...] = ()) -> dict:
    from common.processor import load_processor

    rows = []
    for plan in plans:
        model = model_dir(plan.width)
        processor = load_processor(model)
        stamp = time.strftime("%H%M%S")
        jobs = [(job, prompts(processor, job, f"{plan.width}{stamp}{k}")) for k, job in enumerate(plan.jobs)]
        t0 = time.monotonic()
        pairs = run_jobs(model, jobs, log, env, worker_args)
        log(f"{plan.width} widths: every job on both sides in {time.monotonic() - t0:.0f} s")
        for (job, reqs), (s, p) in zip(jobs, pairs, strict=True):
            contexts = [len(ids) + job.new_tokens / 2 for _, ids in reqs]  # mean over the decode steps
            same = sum(a == b for a, b in zip(s["tokens"], p["tokens"], strict=True))
            rows.append({"width": plan.width, "job": job.name, "n": job.n, "new_tokens": job.new_tokens,
                         "mean_prompt": sum(len(ids) for _, ids in reqs) / job.n, "attended": sum(contexts),
                         "served": {k: v for k, v in s.items() if k != "tokens"},
                         "plain": {k: v for k, v in p.items() if k != "tokens"},
                         "requests_equal": same})  # fmt: skip
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rank.rank_engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the short 2B-width form (make bench-quick)")
    parser.add_argument(
        "--widths",
        default="",
        help="comma-separated subset of 2b,2b-vocab1k,7b,qwen3-2b (default: the "
        "plan's; a width the chosen plan lacks runs with the plan's 2B jobs)",
    )
    parser.add_argument("--out", help="folder for rank_engine.md/.json/.png")
    parser.add_argument("--worker-tree", help="run the group's processes from this source tree (a before/after check)")
    parser.add_argument(
        "--jobs",
        default="",
        help="comma-separated subset of the plan's jobs as NAME:N (e.g. equal:16,mixed:16; default: all)",
    )
    parser.add_argument(
        "--cpu-linear",
        choices=("auto", "onednn", "dense"),
        help="the rank's --cpu-linear (default: the rank's own, auto): dense shows the share of the packed weights",
    )
    parser.add_argument("--reference", help=argparse.SUPPRESS)  # internal: the transformers process
    args = parser.parse_args(argv)
    if args.reference:
        reference_main(args.reference)
        return 0
    plans = PLANS["quick" if args.quick else "full"]
    if args.widths:
        wanted_widths = args.widths.split(",")
        unknown = set(wanted_widths) - {p.width for p in PLANS["full"]}
        if unknown:
            parser.error(f"--widths {args.widths}: unknown {sorted(unknown)}; choose from 2b, 2b-vocab1k, 7b, qwen3-2b")
        two_b = next(p for p in plans if p.width == "2b")
        plans = tuple(next((p for p in plans if p.width == w), Plan(w, two_b.jobs)) for w in wanted_widths)
    if args.jobs:
        wanted = set(args.jobs.split(","))
        plans = tuple(Plan(p.width, tuple(j for j in p.jobs if f"{j.name}:{j.n}" in wanted)) for p in plans)
        plans = tuple(p for p in plans if p.jobs)
        if not plans:
            parser.error(f"--jobs {args.jobs}: no job of the plan matches (names: equal, mixed, context)")
    env = dict(os.environ, PYTHONPATH=args.worker_tree) if args.worker_tree else None
    worker_args = ("--cpu-linear", args.cpu_linear) if args.cpu_linear else ()
    result = measure(plans, log=lambda m: print(m, file=sys.stderr, flush=True), env=env, worker_args=worker_args)
    result["cpu_linear"] = args.cpu_linear or "auto"
    print(write(args.out, result) if args.out else tables(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
