"""Figures, ratios, goals, token agreement, tables and the plot of ``benchmarks/peer.py``.

Ratios are mmcast / vLLM: for TTFT slopes lower is better, for throughput at the SLO higher is better. An engine
"holds" a load rate when no request failed, the p99 TTFT is within the SLO, and the p99 of the time a
conversation's next question waited for its previous answer past its scheduled arrival is within the SLO too: a
chat user cannot ask before the answer came, so an engine that falls behind the schedule shows there, not in the
TTFT of the questions it delays.

Greedy texts are compared as token ids (the checkpoint's tokenizer) after dropping trailing U+FFFD: when
``max_tokens`` cuts a multi-byte character, mmcast streams the incomplete bytes as U+FFFD and vLLM holds them back
(counted as ``trailing_incomplete_char``).
"""

from __future__ import annotations

import os


def _slope(result: dict | None) -> float | None:
    return (result or {}).get("slope", {}) and result["slope"]["slope"]


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def holds(point: dict, slo_ms: float) -> bool:
    if not point.get("completed") or point["failed"]:
        return False
    return point["ttft_p99_ms"] <= slo_ms and point["conversation_wait_p99_ms"] <= slo_ms


def at_slo(points: list[dict], slo_ms: float) -> dict:
    """The highest offered rate held, and the request throughput measured there (0 when none is held)."""
    held = [p for p in points if holds(p, slo_ms)]
    if not held:
        return {"rate": None, "request_throughput": 0.0}
    best = max(held, key=lambda p: p["rate"])
    return {"rate": best["rate"], "request_throughput": best["request_throughput"],
            "output_token_throughput": best["output_token_throughput"]}  # fmt: skip


def agreement(results: dict, model_dir: str) -> dict:
    """Per mmcast engine against vLLM: requests with the same text, and the share of vLLM's tokens up to the first
    difference (the checkpoint's tokenizer)."""
    from transformers import AutoTokenizer

    if "vllm" not in results:
        return {}
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = results["vllm"]["texts"]
    out = {}
    for name, res in results.items():
        if name == "vllm":
            continue
        keys = sorted(set(ref) & set(res["texts"]))
        equal = same_prefix = total = trailing = 0
        differ = []
        for key in keys:
            ta, tb = ref[key], res["texts"][key]
            trailing += ta.endswith("\ufffd") != tb.endswith("\ufffd")
            a, b = tok.encode(ta.rstrip("\ufffd")), tok.encode(tb.rstrip("\ufffd"))
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            same_prefix += n
            total += len(a)
            if a == b:
                equal += 1
            elif len(differ) < 5:
                differ.append(key)
        out[name] = {"requests": len(keys), "equal": equal, "token_prefix_share": same_prefix / total if total else None,
                     "trailing_incomplete_char": trailing, "first_differences": differ}  # fmt: skip
    return out


def analyze(results: dict, model_dir: str, slo_ms: float) -> dict:
    for res in results.values():  # the schedule's span: what the rate offered over this sample
        for p in res.get("load", []):
            p["schedule_s"] = max((r["at_s"] for r in p["rows"]), default=None)
            p["holds_slo"] = holds(p, slo_ms)
    figures = {}
    for name, res in results.items():
        figures[name] = {
            "cached_ttft_slope_ms": _slope(res.get("cached")),
            "new_image_ttft_slope_ms": {size: _slope(r) for size, r in res.get("new", {}).items()},
            "at_slo": at_slo(res.get("load", []), slo_ms),
            "sliding_ttft_mean_after_window_ms": (res.get("sliding") or {}).get("ttft_mean_after_window_ms"),
        }
    ratios = {}
    v = figures.get("vllm")
    for name in (n for n in figures if n != "vllm"):
        m = figures[name]
        suffix = "" if name == "mmcast_tp1" else f"_{name.removeprefix('mmcast_')}"
        if v is None:
            break
        ratios["cached_ttft_slope_ratio" + suffix] = _ratio(m["cached_ttft_slope_ms"], v["cached_ttft_slope_ms"])
        ratios["new_image_ttft_ratio" + suffix] = _ratio(
            m["new_image_ttft_slope_ms"].get("448x448"), v["new_image_ttft_slope_ms"].get("448x448")
        )
        for size in m["new_image_ttft_slope_ms"]:
            if size != "448x448":
                ratios[f"new_image_ttft_ratio_{size}" + suffix] = _ratio(
                    m["new_image_ttft_slope_ms"][size], v["new_image_ttft_slope_ms"].get(size)
                )
        ratios["throughput_at_slo_ratio" + suffix] = _ratio(
            m["at_slo"]["request_throughput"], v["at_slo"]["request_throughput"]
        )
        ratios["sliding_ttft_ratio" + suffix] = _ratio(
            m["sliding_ttft_mean_after_window_ms"], v["sliding_ttft_mean_after_window_ms"]
        )
    return {
        "figures": figures,
        "ratios": ratios,
        "goals": goals(figures, ratios),
        "agreement": agreement(results, model_dir),
        "slo_ttft_p99_ms": slo_ms,
    }


def _fmt(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


TIE_TOLERANCE = 0.01  # at one offered rate, both engines' req/s differ by when the last answer lands, not capacity


def throughput_held(mmcast: dict, vllm: dict) -> bool:
    """mmcast holds at least vLLM's throughput at the SLO: a higher rate held, or the same offered rate held with
    req/s within ``TIE_TOLERANCE`` (a Poisson schedule's achieved rate is its arrivals' over the run's span, so
    two engines that serve every request of the same schedule tie up to the last answer's time)."""
    if mmcast.get("rate") is None or vllm.get("rate") is None:
        return mmcast.get("rate") is not None
    if mmcast["rate"] != vllm["rate"]:
        return mmcast["rate"] > vllm["rate"]
    return mmcast["request_throughput"] >= (1 - TIE_TOLERANCE) * vllm["request_throughput"]


def goals(figures: dict, ratios: dict) -> list[dict]:
    out = []

    def goal(name: str, ok: bool | None, measured: str) -> None:
        out.append({"name": name, "status": "n/a" if ok is None else ("met" if ok else "missed"), "measured": measured})

    r = ratios.get("cached_ttft_slope_ratio")
    goal(
        "TP1 cached-image TTFT slope <= vLLM's",
        None if r is None else r <= 1,
        f"ratio {_fmt(r)} ({_fmt(figures.get('mmcast_tp1', {}).get('cached_ttft_slope_ms'))} vs "
        f"{_fmt(figures.get('vllm', {}).get('cached_ttft_slope_ms'))} ms/image)",
    )
    r = ratios.get("new_image_ttft_ratio")
    m = figures.get("mmcast_tp1", {}).get("new_image_ttft_slope_ms", {}).get("448x448")
    v = figures.get("vllm", {}).get("new_image_ttft_slope_ms", {}).get("448x448")
    goal(
        "TP1 TTFT per new 448x448 image <= vLLM's",
        None if r is None else r <= 1,
        f"ratio {_fmt(r)} ({_fmt(m, 1)} vs {_fmt(v, 1)} ms/image)",
    )
    r = ratios.get("throughput_at_slo_ratio")
    m, v = (figures.get(e, {}).get("at_slo", {}) for e in ("mmcast_tp1", "vllm"))
    goal(
        "TP1 request throughput at the SLO >= vLLM's",
        None if r is None else throughput_held(m, v),
        f"ratio {_fmt(r)} ({_fmt(m.get('request_throughput'), 3)} req/s at {m.get('rate')}/s offered vs "
        f"{_fmt(v.get('request_throughput'), 3)} at {v.get('rate')}/s)",
    )
    t1, t2 = figures.get("mmcast_tp1"), figures.get("mmcast_tp2")
    if t1 and t2:
        pairs = [
            ("cached slope", t1["cached_ttft_slope_ms"], t2["cached_ttft_slope_ms"]),
            (
                "new-image slope",
                t1["new_image_ttft_slope_ms"].get("448x448"),
                t2["new_image_ttft_slope_ms"].get("448x448"),
            ),
            ("sliding TTFT", t1["sliding_ttft_mean_after_window_ms"], t2["sliding_ttft_mean_after_window_ms"]),
        ]
        ok = all(b is not None and a is not None and b <= a for _, a, b in pairs)
        goal(
            "TP2 no worse than TP1 per request", ok, "; ".join(f"{n} TP2/TP1 {_fmt(_ratio(b, a))}" for n, a, b in pairs)
        )
    return out


# --- markdown ----------------------------------------------------------------------------------------------------


def _ci(slope: dict | None, digits: int = 2) -> str:
    if not slope:
        return "–"
    return f"{slope['slope']:.{digits}f} [{slope['ci_low']:.{digits}f}, {slope['ci_high']:.{digits}f}]"


def tables(results: dict, analysis: dict) -> str:
    lines = []
    names = list(results)
    ns = sorted({int(n) for res in results.values() for n in res["cached"]["ttft_p50_by_n"]})
    lines += ["Cached images (all prefix-cached, then a new question): client TTFT p50, ms", "",
              "| engine | " + " | ".join(f"N={n}" for n in ns) + " | slope ms/image [95 % CI] | cached tokens at N="
              f"{ns[-1]} |", "|---|" + "---:|" * (len(ns) + 2)]  # fmt: skip
    for name in names:
        c = results[name]["cached"]
        by_n = {int(k): v for k, v in c["ttft_p50_by_n"].items()}
        cached = [r["cached_tokens"] for r in c["rows"] if r["n"] == ns[-1]]
        prompt = [r["prompt_tokens"] for r in c["rows"] if r["n"] == ns[-1]]
        lines.append(
            f"| {name} | "
            + " | ".join(_fmt(by_n.get(n), 1) for n in ns)
            + f" | {_ci(c['slope'])} | {cached[0] if cached else '–'} of {prompt[0] if prompt else '–'} |"
        )
    for size in next(iter(results.values()))["new"]:
        ns = sorted({int(n) for res in results.values() for n in res["new"][size]["ttft_p50_by_n"]})
        lines += [
            "",
            f"New {size} JPEGs (never seen) per request: client TTFT p50, ms",
            "",
            "| engine | " + " | ".join(f"N={n}" for n in ns) + " | slope ms/new image [95 % CI] |",
            "|---|" + "---:|" * (len(ns) + 1),
        ]
        for name in names:
            r = results[name]["new"][size]
            by_n = {int(k): v for k, v in r["ttft_p50_by_n"].items()}
            lines.append(f"| {name} | " + " | ".join(_fmt(by_n.get(n), 1) for n in ns) + f" | {_ci(r['slope'], 1)} |")
    slo = analysis["slo_ttft_p99_ms"]
    lines += ["", f"Multi-turn chat under Poisson arrivals (SLO: p99 TTFT ≤ {slo:.0f} ms, and p99 of a "
              f"conversation's wait for its previous answer ≤ {slo:.0f} ms)", "",
              "| engine | rate /s | done | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 / p99 | req/s | out tok/s | "
              "conv. wait p99 | holds |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name in names:
        for p in results[name]["load"]:
            if not p.get("completed"):
                lines.append(f"| {name} | {p['rate']:g} | 0/{p['offered']} | – | – | – | – | – | – | – | no |")
                continue
            lines.append(
                f"| {name} | {p['rate']:g} | {p['completed']}/{p['offered']} | {p['ttft_p50_ms']:.0f} | "
                f"{p['ttft_p99_ms']:.0f} | {_fmt(p['tpot_p50_ms'], 1)} | {_fmt(p['itl_p50_ms'], 1)} / "
                f"{_fmt(p['itl_p99_ms'], 1)} | {p['request_throughput']:.3f} | {p['output_token_throughput']:.1f} | "
                f"{p['conversation_wait_p99_ms']:.0f} | {'yes' if p['holds_slo'] else 'no'} |"
            )
    lines += ["", "| engine | highest rate held | req/s there |", "|---|---:|---:|"]
    for name in names:
        s = analysis["figures"][name]["at_slo"]
        lines.append(f"| {name} | {s['rate'] if s['rate'] is not None else 'none'} | {s['request_throughput']:.3f} |")
    s0 = next(iter(results.values()))["sliding"]
    lines += [
        "",
        f"Sliding window ({len(s0['rows'])} turns, last {s0['window']} images kept): client TTFT, ms",
        "",
        "| engine | mean, all turns | mean after the window fills | cached tokens per turn after it (mean) |",
        "|---|---:|---:|---:|",
    ]
    for name in names:
        s = results[name]["sliding"]
        after = [r["cached_tokens"] or 0 for r in s["rows"] if r["turn"] > s["window"]]
        lines.append(
            f"| {name} | {s['ttft_mean_ms']:.1f} | {_fmt(s['ttft_mean_after_window_ms'], 1)} | "
            f"{_fmt(sum(after) / len(after) if after else None, 0)} |"
        )
    lines += ["", "| ratio (mmcast / vLLM) | value |", "|---|---:|"]
    lines += [f"| `{k}` | {_fmt(v)} |" for k, v in analysis["ratios"].items()]
    lines += ["", "| goal | measured | status |", "|---|---|---|"]
    lines += [f"| {g['name']} | {g['measured']} | {g['status']} |" for g in analysis["goals"]]
    if analysis["agreement"]:
        lines += [
            "",
            "Greedy tokens against vLLM's (same inputs, random weights)",
            "",
            "| engine | requests with equal tokens | vLLM's tokens matched up to the first difference | "
            "trailing U+FFFD only one side |",
            "|---|---:|---:|---:|",
        ]
        for name, a in analysis["agreement"].items():
            lines.append(
                f"| {name} | {a['equal']}/{a['requests']} | {_fmt(100 * (a['token_prefix_share'] or 0), 1)} % "
                f"| {a['trailing_incomplete_char']} |"
            )
    return "\n".join(lines)


def write_markdown(path: str, meta: dict, results: dict, analysis: dict, figures: list[str]) -> None:
    m = meta["machine"]
    head = [
        f"# mmcast beside vLLM — {meta['timestamp']}",
        "",
        f"Plan `{meta['plan']['name']}`, checkpoint `{meta['model_dir']}` (width {meta['width']}, float32), "
        f"commit {meta['git']['commit'][:10]}{' (dirty)' if meta['git']['dirty'] else ''}, "
        f"{m['cpu']}, {m['cores']} cores, {m['memory_gib']:.0f} GiB. Versions: {meta['versions']}.",
        f"Load average before {m['loadavg_before']}, after {m['loadavg_after']}; whole run "
        f"{meta['wall_seconds'] / 60:.1f} min.",
        "",
        "| engine | start-up s | load average at start → end | engine CPU s per workload |",
        "|---|---:|---|---|",
    ]
    for name, res in results.items():
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in res["engine_cpu_s"].items())
        head.append(f"| {name} | {res['startup_s']:.1f} | {res['loadavg_start']} → {res['loadavg_end']} | {cpu} |")
    body = tables(results, analysis)
    tail = [f"![{os.path.basename(f)}]({os.path.basename(f)})" for f in figures]
    if analysis.get("profile"):
        tail += ["", "## Profile (mmcast TP 1, py-spy; not a timed run)", "", analysis["profile"]["markdown"]]
    with open(path, "w") as f:
        f.write("\n".join(head) + "\n\n" + body + "\n\n" + "\n".join(tail) + "\n")


# --- plot --------------------------------------------------------------------------------------------------------

_COLOURS = {
    "vllm": "tab:blue",
    "mmcast_tp1": "tab:green",
    "mmcast_tp2": "tab:olive",
    "mmcast_tp1_threads1": "tab:red",
    "mmcast_tp1_threads2": "tab:purple",
}


def write_plots(directory: str, results: dict, analysis: dict, slo_ms: float) -> list[str]:
    try:
        import matplotlib
    except ImportError:
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.4))
    for name, res in results.items():
        colour = _COLOURS.get(name)
        pts = sorted((int(n), v) for n, v in res["cached"]["ttft_p50_by_n"].items())
        axes[0].plot(*zip(*pts, strict=True), "-o", color=colour, label=name)
        for size, r in res["new"].items():
            pts = sorted((int(n), v) for n, v in r["ttft_p50_by_n"].items())
            axes[1].plot(
                *zip(*pts, strict=True), "-o" if size == "448x448" else "--s", color=colour, label=f"{name} {size}"
            )
        load = [p for p in res["load"] if p.get("completed")]
        if load:
            axes[2].plot(
                [p["rate"] for p in load], [p["ttft_p99_ms"] for p in load], "-o", color=colour, label=f"{name} p99"
            )
            axes[2].plot(
                [p["rate"] for p in load], [p["ttft_p50_ms"] for p in load], ":^", color=colour, label=f"{name} p50"
            )
        rows = res["sliding"]["rows"]
        axes[3].plot(
            [r["turn"] for r in rows], [r["ttft_ms"] for r in rows], "-o", markersize=3, color=colour, label=name
        )
    axes[2].axhline(slo_ms, color="k", lw=0.8, ls="--", label=f"SLO {slo_ms:.0f} ms")
    titles = (("cached images, then a new question", "images in the prompt N", "TTFT p50 (ms)"),
              ("new images per request", "new images N", "TTFT p50 (ms)"),
              ("multi-turn chat, Poisson arrivals", "offered requests/s", "TTFT (ms)"),
              (f"sliding window (last {next(iter(results.values()))['sliding']['window']} images)", "turn",
               "TTFT (ms)"))  # fmt: skip
    for ax, (title, xl, yl) in zip(axes, titles, strict=True):
        ax.set_title(title)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[2].set_yscale("log")
    path = os.path.join(directory, "peer.png")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]
