"""The rank's sampler per step and per row, vectorised against per-row, side by side in one run:
``python -m benchmarks.rank.sampler [--vocabs 1024,151936] [--ns 1,4,16,64] [--repeats 15] [--threads 1] [--out DIR]``.

Each cell is one batch of N rows of random float32 logits in one mix of sampling parameters, timed as the rank's
step calls it (``sample_batch`` with the step's histories and grammar masks, the masks' unpacking from their
packed bytes included): the vectorised sampler (``worker_svc/sampling.py``) and the per-row one it replaced
(``benchmarks/rank/sampler_per_row.py``), interleaved call by call so the machine's load of the moment falls on both.
Reported: the median of ``--repeats`` calls per step and per row, and new / old. Greedy tokens are checked equal
between the two (drawn tokens differ by design: the draw changed from ``torch.multinomial`` to inverse-CDF).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from benchmarks.rank import sampler_per_row
from benchmarks.support import stats
from common.penalties import Penalties
from worker_svc import sampling
from worker_svc.token_mask import allowed_rows, allowed_tokens, mask_nbytes

MIXES = ("greedy", "temperature", "top_p", "top_k", "masked", "penalised", "mixed")
_PENALTIES = Penalties(frequency_penalty=0.5, presence_penalty=0.3, logit_bias=((5, 2.0), (9, -1.0)))


def _params(mix: str, i: int) -> tuple[sampling.RowSampling, bool]:
    """Row i's parameters in ``mix``, and whether it carries a grammar mask."""
    if mix == "mixed":
        mix = MIXES[i % (len(MIXES) - 1)]
    seeded = {"temperature": 1.0, "seed": 1000 + i}
    return {
        "greedy": (sampling.RowSampling(), False),
        "temperature": (sampling.RowSampling(**seeded), False),
        "top_p": (sampling.RowSampling(top_p=0.9, **seeded), False),
        "top_k": (sampling.RowSampling(top_k=50, **seeded), False),
        "masked": (sampling.RowSampling(**seeded), True),
        "penalised": (sampling.RowSampling(penalties=_PENALTIES, **seeded), False),
    }[mix]


def _cell(vocab: int, n: int, mix: str, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(n)
    logits = torch.randn(n, vocab, generator=gen) * 3
    rows = [_params(mix, i) for i in range(n)]
    params = [p for p, _ in rows]
    masked = [i for i, (_, m) in enumerate(rows) if m]
    packed = {
        i: torch.randint(0, 256, (mask_nbytes(vocab),), generator=gen, dtype=torch.uint8).numpy().tobytes()
        for i in masked
    }
    histories = [(list(range(40)) + [7, 7, 3], 40)] * n
    indices = [3] * n

    def new():
        unpacked = allowed_rows([packed[i] for i in masked], vocab) if masked else None
        allowed = {i: unpacked[j] for j, i in enumerate(masked)}
        return sampling.sample_batch(logits, params, indices, histories, allowed)

    def old():
        allowed = {i: allowed_tokens(packed[i], vocab) for i in masked}
        return sampler_per_row.sample_batch(logits, params, indices, histories, allowed)

    got_new, got_old = new(), old()  # warm both, and compare the greedy rows
    for p, a, b in zip(params, got_new, got_old, strict=True):
        if sampling.is_greedy(p.temperature) and a.token_id != b.token_id:
            raise AssertionError(f"greedy tokens differ between the samplers: {a.token_id} vs {b.token_id}")
    times: dict[str, list[float]] = {"new": [], "old": []}
    for _ in range(repeats):
        for name, fn in (("new", new), ("old", old)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out = {"vocab": vocab, "n": n, "mix": mix}
    for name, values in times.items():
        step_ms = 1000 * stats.median(values)
        out[f"{name}_step_ms"] = round(step_ms, 4)
        out[f"{name}_row_us"] = round(1000 * step_ms / n, 2)
    out["new_over_old"] = round(out["new_step_ms"] / out["old_step_ms"], 3)
    return out


def measure(vocabs: list[int], ns: list[int], repeats: int) -> list[dict]:
    return [_cell(v, n, mix, repeats) for v in vocabs for n in ns for mix in MIXES]


def table(records: list[dict]) -> str:
    lines = [
        "| vocab | N | mix | per-row ms/step | vectorised ms/step | per-row µs/row | vectorised µs/row | new/old |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in records:
        lines.append(
            f"| {r['vocab']} | {r['n']} | {r['mix']} | {r['old_step_ms']:.3f} | {r['new_step_ms']:.3f} "
            f"| {r['old_row_us']:.1f} | {r['new_row_us']:.1f} | {r['new_over_old']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default="1024,151936", help="comma-separated vocabulary sizes")
    parser.add_argument("--ns", default="1,4,16,64", help="comma-separated batch sizes (rows per step)")
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per cell and sampler")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a TP1 serve-local rank on 2 CPUs: 1)")
    parser.add_argument("--out", default=None, help="folder for sampler.md and sampler.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    records = measure(
        [int(v) for v in args.vocabs.split(",")], [int(n) for n in args.ns.split(",")], max(1, args.repeats)
    )
    text = table(records)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "sampler.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "sampler.json"), "w") as f:
            json.dump({"torch_threads": torch.get_num_threads(), "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
