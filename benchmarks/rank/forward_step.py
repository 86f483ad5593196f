"""The rank's forward for one step, attention by attention: ``python -m benchmarks.rank.forward_step [--width
head64|real] [--repeats N] [--baseline-tree DIR] [--backends cpu,sdpa] [--out DIR]``.

One in-process ``ModelRunner`` (TP 1, float32, the CPUs this process may use) runs three steps: a prefill of
1,100 tokens without a computed prefix (a conversation's turn once its sliding window has filled: every token is
prefilled again), the same 1,100 tokens after 256 cached ones, and a decode step of 16 requests at ~1k tokens of
context whose block tables interleave (as a served batch's do). Each step runs under every variant in turn — the
attention backends named, and with ``--baseline-tree`` another checkout's ``worker_svc/paged_attention.py`` behind
the same runner — the order alternating from one repeat to the next, so a machine whose load drifts weighs on all
alike. Reported per step and variant: the median time of the forward, the speed-up over the first variant, and the
largest difference of its logits from the first variant's (with whether every greedy token agrees).

Checkpoints as ``benchmarks/peer/compare.py`` builds them: ``head64`` (the tiny recipe with 64-wide heads, vLLM's
comparison model) or ``real`` (2 layers at Qwen2-VL-2B widths).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import types

import torch

from benchmarks.support.paths import RESULTS

PREFILL, PREFIX, DECODES, CONTEXT = 1100, 256, 16, 1024


class BaselineBackend:
    """A checkout's ``paged_attention.py`` of the one-function form (``plan_step`` and ``paged_attention``)."""

    def __init__(self, tree: str) -> None:
        path = os.path.join(tree, "worker_svc", "paged_attention.py")
        spec = importlib.util.spec_from_file_location(f"baseline_forward_{abs(hash(tree))}", path)
        self.module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = self.module  # dataclasses resolve their module's namespace while the class is built
        spec.loader.exec_module(self.module)
        self.name = "baseline"

    def plan(self, pool, windows, block_size):
        return self.module.plan_step(pool, windows, block_size)

    def write(self, plan, layer, key, value) -> None:
        self.kv = (key, value)  # the old function writes and attends in one call

    def attend(self, plan, layer, query, scaling):
        module = types.SimpleNamespace(layer_idx=layer)
        key, value = self.kv
        return self.module.paged_attention(module, query[None], key[None], value[None], None, scaling, paged_step=plan)[
            0
        ][0]


def steps(runner) -> dict:
    """The three steps' windows as functions building fresh ``ForwardInput``s."""
    from worker_svc.runner import ForwardInput

    size = runner.block_size

    def window(blocks, start, n):
        positions = torch.arange(start, start + n)[None].repeat(3 if runner.uses_mrope else 1, 1)
        return ForwardInput(blocks, start, [(i * 7 + start) % 900 + 5 for i in range(n)], positions, [], True)

    blocks = -(-(PREFIX + PREFILL) // size)
    per_decode = -(-(CONTEXT + DECODES) // size)
    return {
        f"prefill {PREFILL}": lambda: [window(list(range(blocks)), 0, PREFILL)],
        f"prefill {PREFILL} after {PREFIX}": lambda: [window(list(range(blocks)), PREFIX, PREFILL)],
        f"decode N={DECODES} @{CONTEXT}": lambda: [
            window([blocks + j + DECODES * b for b in range(per_decode)], CONTEXT + j, 1) for j in range(DECODES)
        ],
    }


def measure(model: str, variants: dict, repeats: int, log=print) -> list[dict]:
    """Runs every step under every variant (name -> backend, or a backend name for this tree's)."""
    from worker_svc import attention_backends
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ModelRunner

    config = WorkerConfig(model=model, listen="127.0.0.1:0", kv_blocks=2048, insecure_allow_unauthenticated=True)
    torch.set_num_threads(config.threads)
    runner = ModelRunner(config)
    backends = {
        name: attention_backends.select(b, runner.device) if isinstance(b, str) else b for name, b in variants.items()
    }
    records = []
    for step, build in steps(runner).items():
        times, logits = {name: [] for name in backends}, {}
        for repeat in range(repeats + 1):  # the first round warms up
            order = list(backends.items())
            for name, backend in order if repeat % 2 else order[::-1]:
                runner.attention = backend
                start = time.perf_counter()
                logits[name] = runner.forward(build()).batch
                if repeat:
                    times[name].append(time.perf_counter() - start)
        first = next(iter(backends))
        for name in backends:
            ms = statistics.median(times[name]) * 1e3
            records.append({
                "step": step, "variant": name, "ms": ms,
                "speedup": statistics.median(times[first]) * 1e3 / ms,
                "max_logit_diff": (logits[name] - logits[first]).abs().max().item(),
                "greedy_equal": bool((logits[name].argmax(-1) == logits[first].argmax(-1)).all()),
            })  # fmt: skip
            log(f"{step}: {name} {ms:.1f} ms")
    return records


def table(records: list[dict]) -> str:
    lines = [
        "| step | variant | median ms | speed-up | max logit diff | greedy equal |",
        "|---|---|---:|---:|---:|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['step']} | {r['variant']} | {r['ms']:.1f} | {r['speedup']:.2f}× | {r['max_logit_diff']:.1e} "
            f"| {r['greedy_equal']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", choices=("head64", "real"), default="head64")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--backends", default="cpu", help="this tree's backends, comma-separated (cpu, sdpa)")
    parser.add_argument("--baseline-tree", help="also run this checkout's worker_svc/paged_attention.py")
    parser.add_argument("--out", help="folder for forward_step.md/.json")
    args = parser.parse_args(argv)
    from common.tiny_model import ensure_tiny_model

    model = ensure_tiny_model(
        os.path.join(RESULTS, ".model", f"qwen2_vl-{args.width}-width"), width=args.width, replace_stale=True
    )
    variants: dict = {"baseline": BaselineBackend(args.baseline_tree)} if args.baseline_tree else {}
    variants.update({name: name for name in args.backends.split(",")})
    records = measure(str(model), variants, args.repeats)
    print(table(records))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "forward_step.json"), "w") as f:
            json.dump(records, f, indent=1)
        with open(os.path.join(args.out, "forward_step.md"), "w") as f:
            f.write(table(records) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
