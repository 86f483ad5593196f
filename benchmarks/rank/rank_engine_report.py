"""The rank-engine comparison's report (``rank_engine.py``): tokens/s per phase, the tables (served against
transformers per job; a decode step's time per attended token), the plot, and the files written to ``--out``."""

from __future__ import annotations

import json
import os


def rate(side: dict, kind: str) -> float:
    """Tokens/s of a phase: ``prefill`` (prompt tokens), ``decode`` (tokens after the last first token) or
    ``total`` (every new token over the whole job, prefill included: ``total_seconds`` where the side measured
    its decode on a pass of its own, as the served side does)."""
    tokens = {"prefill": side["prompt_tokens"], "decode": side["decode_tokens"], "total": side["new_tokens"]}[kind]
    if kind == "total":
        seconds = side.get("total_seconds", side["prefill_seconds"] + side["decode_seconds"])
    else:
        seconds = side[f"{kind}_seconds"]
    return tokens / seconds if seconds else float("nan")


def _passes(served: dict, n: int) -> str:
    """The decode pass's agreement with the first pass (``rank_engine_served``), where measured."""
    same = served.get("decode_pass_equal")
    return "" if same is None else f" (decode pass {same}/{n})"


def tables(result: dict) -> str:
    lines = [
        "| widths | prompts | N | mean prompt | prefill tok/s mmcast / transformers | decode tok/s mmcast | "
        "decode tok/s transformers | decode ratio | end-to-end tok/s mmcast / transformers | rank step ms | "
        "greedy equal |",
        "|---|---|---:|---:|---|---:|---:|---:|---|---:|---:|",
    ]
    for r in result["rows"]:
        if r["job"] == "context":
            continue
        s, p = r["served"], r["plain"]
        lines.append(
            f"| {r['width'].upper()} | {r['job']} | {r['n']} | {r['mean_prompt']:.0f} | "
            f"{rate(s, 'prefill'):.0f} / {rate(p, 'prefill'):.0f} | {rate(s, 'decode'):.1f} | "
            f"{rate(p, 'decode'):.1f} | **{rate(s, 'decode') / rate(p, 'decode'):.2f}×** | "
            f"{rate(s, 'total'):.1f} / {rate(p, 'total'):.1f} | {s['rank_step_ms']:.1f} | "
            f"{r['requests_equal']}/{r['n']}{_passes(s, r['n'])} |"
        )
    lines += [
        "",
        "| widths | context | rank step ms | transformers step ms | rank µs / attended token | "
        "transformers µs / attended token | ratio |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(
        (r for r in result["rows"] if r["n"] == 16 and r["job"] in ("equal", "context")),
        key=lambda r: (r["width"], r["mean_prompt"]),
    ):
        s, p = r["served"]["rank_step_ms"], r["plain"]["step_ms"]
        lines.append(
            f"| {r['width'].upper()} | {r['mean_prompt']:.0f} | {s:.1f} | {p:.1f} | "
            f"{1e3 * s / r['attended']:.2f} | {1e3 * p / r['attended']:.2f} | {s / p:.2f} |"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    widths = sorted({r["width"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(widths), figsize=(5.5 * len(widths), 3.8), squeeze=False)
    for ax, width in zip(axes[0], widths, strict=True):
        for job, style in (("equal", "-o"), ("mixed", "-s")):
            rows = sorted((r for r in result["rows"] if r["width"] == width and r["job"] == job), key=lambda r: r["n"])
            if not rows:
                continue
            ns = [r["n"] for r in rows]
            ax.plot(ns, [rate(r["served"], "decode") for r in rows], style, color="tab:green", label=f"mmcast, {job}")
            ax.plot(
                ns,
                [rate(r["plain"], "decode") for r in rows],
                style,
                color="tab:grey",
                label=f"transformers batch, {job}",
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent requests N")
        ax.set_ylabel("decode tokens/s")
        model = "Qwen3-VL, 2B" if width == "qwen3-2b" else f"Qwen2-VL, {width.upper()}"
        ax.set_title(f"2-layer {model} widths, float32")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write(out_dir: str, result: dict) -> str:
    os.makedirs(out_dir, exist_ok=True)
    md = tables(result)
    with open(os.path.join(out_dir, "rank_engine.md"), "w") as f:
        f.write("# The rank's forward against transformers' static batch\n\n" + md + "\n")
    with open(os.path.join(out_dir, "rank_engine.json"), "w") as f:
        json.dump(result, f, indent=1)
    plot(result, os.path.join(out_dir, "rank_engine.png"))
    return md
