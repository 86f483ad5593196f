"""Decode steps over the block tables the scheduler's allocator builds for requests decoding side by side, in
process: ``python -m benchmarks.rank.block_tables [--model-dir DIR] [--requests N] [--prompt T] [--decoded T]``.

``N`` requests are admitted with ``T``-token prompts, then each grows one token at a time, in turn, for ``--decoded``
tokens, as decodes do in a served batch (``scheduler_svc/core/kv_cache.py``). Two allocations of the same growth:

- ``front``: every new block from the front of the free order (admissions without ``final_tokens``): the requests
  take blocks in turn, so every table is a run of one block per decoded block;
- ``room``: admissions give ``final_tokens`` (prompt + decoded), as the scheduler does: each table stays one run.

Each table's tokens are then prefilled into a ``ModelRunner``'s pool and the same decode step of all ``N`` requests
is timed over both tables (one intra-op thread, medians, the two alternated). Reported: runs per table and the step.
The tokens each variant's step samples greedily must be equal (the tables place the same KV differently).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

BLOCK_SIZE = 16


def tables(requests: int, prompt: int, decoded: int, room: bool, num_blocks: int) -> list[list[int]]:
    """The block tables of ``requests`` requests after ``decoded`` tokens each, grown in turn."""
    from scheduler_svc.core.kv_cache import KVCacheManager

    kv = KVCacheManager(num_blocks, BLOCK_SIZE)
    for r in range(requests):
        if kv.allocate(f"r{r}", prompt, (), prompt + decoded if room else 0) is None:
            raise SystemExit(f"{num_blocks} blocks do not hold {requests} requests of {prompt + decoded} tokens")
    for t in range(1, decoded + 1):
        for r in range(requests):
            kv.allocate(f"r{r}", prompt + t)
    return [kv.blocks_of(f"r{r}") for r in range(requests)]


def runs(table: list[int]) -> int:
    return 1 + sum(b != a + 1 for a, b in zip(table, table[1:], strict=False))


def measure(model_dir: str, requests: int, prompt: int, decoded: int, repeats: int) -> dict:
    import torch

    from tests.support.worker_driver import rank_token_file
    from worker_svc.config import WorkerConfig
    from worker_svc.runner import ForwardInput, ModelRunner

    torch.set_num_threads(1)
    context = prompt + decoded
    per = 2 * requests * -(-context // BLOCK_SIZE) + 64  # each variant's blocks; the second's ids follow the first's
    runner = ModelRunner(WorkerConfig(model=model_dir, kv_blocks=2 * per, shared_token_file=rank_token_file()))
    variants = {
        name: [[b + k * per for b in t] for t in tables(requests, prompt, decoded, name == "room", per)]
        for k, name in enumerate(("front", "room"))
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {}
    with torch.inference_mode():
        for tbs in variants.values():  # the same tokens prefilled into each variant's blocks
            for r, table in enumerate(tbs):
                ids = [(7 * r + j) % 900 + 10 for j in range(context - 1)]
                pos = torch.arange(context - 1).expand(3, -1).contiguous()
                runner.forward([ForwardInput(table, 0, ids, pos, [], True)])

        def step(tbs):
            items = [
                ForwardInput(table, context - 1, [5 + r], torch.full((3, 1), context - 1, dtype=torch.long), [], True)
                for r, table in enumerate(tbs)
            ]
            return runner.forward(items)

        for name, tbs in variants.items():
            tokens[name] = step(tbs).batch.argmax(dim=-1).tolist()
        for _ in range(repeats):
            for name, tbs in variants.items():
                t0 = time.perf_counter()
                step(tbs)
                times[name].append(1e3 * (time.perf_counter() - t0))
    return {
        "requests": requests,
        "context": context,
        "runs_per_table": {name: statistics.mean(runs(t) for t in tbs) for name, tbs in variants.items()},
        "step_ms": {name: statistics.median(ts) for name, ts in times.items()},
        "same_tokens": tokens["front"] == tokens["room"],
    }


def report(result: dict) -> str:
    ms, rn = result["step_ms"], result["runs_per_table"]
    return "\n".join(
        [
            f"## {result['requests']} decodes at {result['context']} tokens of context, tables grown side by side",
            "",
            "| allocation | runs per table | decode step (ms, median) |",
            "|---|---:|---:|",
            *(f"| {name} | {rn[name]:.1f} | {ms[name]:.2f} |" for name in ("front", "room")),
            "",
            f"room / front: {ms['room'] / ms['front']:.2f}x; greedy tokens equal: {result['same_tokens']}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    from common.tiny_model import ensure_tiny_model

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rank.block_tables", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model-dir", help="checkpoint (default: the tiny model, built if missing)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=300)
    parser.add_argument("--decoded", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=40)
    args = parser.parse_args(argv)
    model_dir = args.model_dir or str(ensure_tiny_model(os.path.join("benchmarks", "results", ".model", "qwen2_vl")))
    result = measure(model_dir, args.requests, args.prompt, args.decoded, args.repeats)
    print(report(result))
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
