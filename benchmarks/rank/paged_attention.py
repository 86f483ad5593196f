"""The rank's paged attention over a fragmented block table against a contiguous one, in process:
``python -m benchmarks.rank.paged_attention [--quick] [--baseline-tree DIR] [--out DIR]``.

One layer's attention call (``worker_svc/paged_attention.py``'s ``_attend``) for one request, the same keys and values
written twice into one pool: once in consecutive blocks (one run: a view of the pool) and once in blocks drawn at
random (one run per block, as a table looks after interleaved decodes or a cached prefix plus new blocks). Windows: a
decode token (n = 1) and a prefill chunk, at contexts of 256, 1k and 4k tokens; widths of the ``head64`` tiny model
(4 query / 2 KV heads of 64) and of Qwen2-VL-2B (12 / 2 of 128). One intra-op thread, best of the repeats.

``--baseline-tree DIR`` times another checkout's ``worker_svc/paged_attention.py`` beside this tree's in the same run
(``git worktree add /tmp/base <commit>``), so a change to the attention path is judged side by side. Both outputs are
checked against plain softmax attention over the gathered rows; a mismatch fails the run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time

import torch

WIDTHS = {"head64": (4, 2, 64), "2b": (12, 2, 128)}  # query heads, KV heads, head dim
BLOCK_SIZE = 16


def load(tree: str | None):
    """``worker_svc.paged_attention`` of this tree, or of the checkout at ``tree``."""
    if tree is None:
        from worker_svc import paged_attention

        return paged_attention
    path = os.path.join(tree, "worker_svc", "paged_attention.py")
    spec = importlib.util.spec_from_file_location(f"baseline_paged_attention_{abs(hash(tree))}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module's namespace while the class is built
    spec.loader.exec_module(module)
    return module


def _reference(q, keys, values, window, scaling):
    groups = q.shape[0] // keys.shape[0]
    k, v = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    context = keys.shape[1]
    allowed = torch.arange(context)[None, :] <= (context - window + torch.arange(window))[:, None]
    return torch.softmax((q @ k.transpose(-1, -2) * scaling).masked_fill(~allowed, float("-inf")), -1) @ v


def case(modules: dict, width: str, context: int, window: int, repeats: int, seed: int) -> list[dict]:
    heads, kv_heads, dim = WIDTHS[width]
    blocks = -(-context // BLOCK_SIZE)
    num_blocks = 3 * blocks + 8
    rng = random.Random(seed)
    contiguous = list(range(4, 4 + blocks))
    fragmented = rng.sample(range(blocks + 8, num_blocks), blocks)
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(1, 2, kv_heads, num_blocks, BLOCK_SIZE, dim, generator=gen)
    pool[0, :, :, fragmented] = pool[0, :, :, contiguous]  # the same context in both tables
    q = torch.randn(heads, window, dim, generator=gen)
    k_layer, v_layer = pool[0, 0].view(kv_heads, -1, dim), pool[0, 1].view(kv_heads, -1, dim)
    scaling = dim**-0.5
    rows = torch.arange(4 * BLOCK_SIZE, 4 * BLOCK_SIZE + context)
    want = _reference(q, k_layer[:, rows], v_layer[:, rows], window, scaling)
    out = []
    for tree, module in modules.items():
        for table_name, table in (("contiguous", contiguous), ("fragmented", fragmented)):
            span = module.plan_step(pool, [(table, context - window, context)], BLOCK_SIZE).spans[0]
            got = module._attend(q, k_layer, v_layer, span, scaling)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                module._attend(q, k_layer, v_layer, span, scaling)
                best = min(best, time.perf_counter() - start)
            out.append(
                {
                    "tree": tree,
                    "width": width,
                    "context": context,
                    "window": window,
                    "table": table_name,
                    "runs": len(module.block_runs(table, context, BLOCK_SIZE)),
                    "us": best * 1e6,
                }
            )
    return out


def measure(quick: bool, baseline_tree: str | None = None, log=print) -> list[dict]:
    torch.set_num_threads(1)
    modules = {"this": load(None)}
    if baseline_tree:
        modules["baseline"] = load(baseline_tree)
    contexts = (256, 1024) if quick else (256, 1024, 4096)
    widths = ("head64",) if quick else ("head64", "2b")
    repeats = 5 if quick else 20
    records = []
    for width in widths:
        for context in contexts:
            for window in (1, min(256, context)):
                records += case(modules, width, context, window, repeats, seed=context + window)
                log(f"  {width} context {context} window {window}: done")
    return records


def table(records: list[dict]) -> str:
    by = {(r["tree"], r["width"], r["context"], r["window"], r["table"]): r for r in records}
    trees = sorted({r["tree"] for r in records}, key=lambda t: t != "this")
    head = "| width | context | window | runs |" + "".join(
        f" {t} contiguous µs | {t} fragmented µs | {t} fragmented / contiguous |" for t in trees
    )
    lines = [head, "|" + "---|" * (4 + 3 * len(trees))]
    for width, context, window in sorted({(r["width"], r["context"], r["window"]) for r in records}):
        runs = by[(trees[0], width, context, window, "fragmented")]["runs"]
        row = f"| {width} | {context} | {window} | {runs} |"
        for t in trees:
            c, f = (
                by[(t, width, context, window, "contiguous")]["us"],
                by[(t, width, context, window, "fragmented")]["us"],
            )
            row += f" {c:.0f} | {f:.0f} | {f / c:.2f} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rank.paged_attention", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="the tiny widths, contexts 256 and 1k")
    parser.add_argument("--baseline-tree", help="also time this checkout's worker_svc/paged_attention.py")
    parser.add_argument("--out", help="folder for paged_attention.md/.json")
    args = parser.parse_args(argv)
    records = measure(args.quick, args.baseline_tree)
    text = table(records)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "paged_attention.json"), "w") as f:
            json.dump(records, f, indent=1)
        with open(os.path.join(args.out, "paged_attention.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
