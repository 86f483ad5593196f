"""What a decode step's linear layers alone cost on this machine: ``python -m benchmarks.rank.decode_floor [--rows N]
[--layers N] [--repeats N]``.

The decoder's products of a Qwen2-VL-2B-width layer (q, k, v, o, gate, up, down: hidden 1,536, 2 KV heads of 128,
MLP 8,960), ``--layers`` of them (2: ``benchmarks.rank.rank_engine``'s checkpoints), random float32 weights, multiplied
by ``--rows`` rows (16: its N=16 decode) as the rank runs them: over oneDNN-packed weights
(``PackedLinear`` of ``worker_svc/cpu_linear.py``), and for comparison as PyTorch's dense ``linear`` (plain transformers'
products). Each way on every thread this process may use and on one, medians of ``--repeats`` passes over all
the layers' products (each weight read from memory in turn, as in a step).

Printed: milliseconds per pass, the weights' bytes per second and the arithmetic rate; and the machine's read rate (a
1 GiB ``sum``). A step can be no faster than its products: that floor, beside the rank's and transformers' whole
steps, says how far an engine can get ahead of the static batch with the same float32 weights (docs/PERFORMANCE.md,
"Reading the pool in place, and decode at N = 16 against the static batch").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from worker_svc.cpu_linear import PackedLinear

HIDDEN, KV, MLP = 1536, 256, 8960
SHAPES = ((HIDDEN, HIDDEN), (KV, HIDDEN), (KV, HIDDEN), (HIDDEN, HIDDEN), (MLP, HIDDEN), (MLP, HIDDEN), (HIDDEN, MLP))


def _median_pass(products, inputs, repeats: int) -> float:
    for _ in range(2):
        for f, x in zip(products, inputs, strict=True):
            f(x)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for f, x in zip(products, inputs, strict=True):
            f(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def read_rate() -> float:
    """Bytes per second of a 1 GiB float32 ``sum`` (median of 5)."""
    x = torch.rand(256 << 20)
    x.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times)


def measure(rows: int = 16, layers: int = 2, repeats: int = 10) -> dict:
    torch.manual_seed(0)
    modules = []
    for _ in range(layers):
        for out_f, in_f in SHAPES:
            m = torch.nn.Linear(in_f, out_f, bias=False)
            torch.nn.init.normal_(m.weight, std=0.02)
            modules.append(m)
    weight_bytes = sum(m.weight.numel() * 4 for m in modules)
    flops = 2 * rows * weight_bytes / 4
    inputs = [torch.randn(rows, m.in_features) for m in modules]
    dense = [lambda x, w=m.weight.detach(): torch.nn.functional.linear(x, w) for m in modules]
    packed = [PackedLinear(m) for m in modules]
    threads = torch.get_num_threads()
    out = {"rows": rows, "layers": layers, "weight_bytes": weight_bytes, "threads": threads, "passes": {}}
    with torch.inference_mode():
        for count in sorted({threads, 1}, reverse=True):
            torch.set_num_threads(count)
            for name, products in (("packed", packed), ("dense", dense)):
                seconds = _median_pass(products, inputs, repeats)
                out["passes"][f"{name}, {count} thread{'s' if count > 1 else ''}"] = {
                    "ms": 1000 * seconds,
                    "weight_gb_s": weight_bytes / seconds / 1e9,
                    "gflop_s": flops / seconds / 1e9,
                }
        torch.set_num_threads(threads)
    out["read_gb_s"] = read_rate() / 1e9
    return out


def table(result: dict) -> str:
    lines = [
        f"{result['layers']} layers at Qwen2-VL-2B widths, {result['rows']} rows, "
        f"{result['weight_bytes'] / 1e6:.0f} MB of float32 weights; machine read rate {result['read_gb_s']:.1f} GB/s",
        "",
        "| products | ms per pass | weights GB/s | GFLOP/s |",
        "|---|---:|---:|---:|",
    ]
    for name, p in result["passes"].items():
        lines.append(f"| {name} | {p['ms']:.2f} | {p['weight_gb_s']:.1f} | {p['gflop_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.rank.decode_floor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(table(measure(args.rows, args.layers, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
