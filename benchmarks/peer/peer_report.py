"""The analysis entry point, token agreement, tables and the plot of ``benchmarks/peer/compare.py``.

Figures, ratios (mmcast / vLLM) and goals are ``benchmarks/peer/peer_analysis.py``'s, over every round; the tables of
single requests and the plot show round 1, the tables of medians every round (``benchmarks/peer/peer_tables.py``). An
engine "holds" a load rate when no request failed, the p99 TTFT is within the SLO, and the p99 of the time a
conversation's next question waited for its previous answer past its scheduled arrival is within the SLO too
(``peer_capacity.holds``): a chat user cannot ask before the answer came, so an engine that falls behind the
schedule shows there, not in the TTFT of the questions it delays.

Greedy texts are compared as token ids (the checkpoint's tokenizer) after dropping trailing U+FFFD: when
``max_tokens`` cuts a multi-byte character, mmcast streams the incomplete bytes as U+FFFD and vLLM holds them back
(counted as ``trailing_incomplete_char``).
"""

from __future__ import annotations

import os

from benchmarks.peer import peer_stages, peer_tables
from benchmarks.peer.peer_analysis import TIE_TOLERANCE, analyze_rounds, at_slo, throughput_held  # noqa: F401 - re-exported
from benchmarks.peer.peer_capacity import holds
from benchmarks.peer.peer_client import PREFIX_KEY


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
            if key.startswith(PREFIX_KEY):  # stopped by the client: the text both engines streamed
                ta, tb = ta[: min(len(ta), len(tb))], tb[: min(len(ta), len(tb))]
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


def _stage_n(by_n: dict, want: int):
    """The accumulators of N = ``want`` (the smallest N of the plan when it has no such N)."""
    if not by_n:
        return None, None
    n = want if (want in by_n or str(want) in by_n) else min(by_n, key=int)
    return int(n), by_n.get(n, by_n.get(str(n)))


def stage_breakdown(rounds: dict[str, list[dict]]) -> dict:
    """Per mmcast engine, for cached N=2, new N=1 and the sliding window's turns after it fills (N: the window's
    images): the stage means over every round's timed requests."""
    out = {}
    for name, runs in rounds.items():
        if name == "vllm":
            continue
        for label, pick, want in (("cached", lambda r: (r.get("cached") or {}).get("stages"), 2),
                                  ("new", lambda r: ((r.get("new") or {}).get("448x448") or {}).get("stages"), 1),
                                  ("sliding", lambda r: (r.get("sliding") or {}).get("stages"), 0)):  # fmt: skip
            picked = [_stage_n(pick(r) or {}, want) for r in runs]
            n = next((k for k, _ in picked if k is not None), want)
            acc = peer_stages.merge([a for _, a in picked])
            out.setdefault(name, {})[label] = {"n": n, "requests": (acc or {}).get("requests", 0),
                                               "stages": peer_stages.means(acc)}  # fmt: skip
    return out


def analyze(rounds: dict[str, list[dict]], model_dir: str, slo_ms: float) -> dict:
    """``rounds``: engine -> its rounds' results (one for quick). Marks each load point held or not, then the
    figures, ratios and goals over the rounds, the token agreement of round 1 and the TTFT breakdown."""
    for runs in rounds.values():
        for res in runs:
            for p in res.get("load", []):  # the schedule's span: what the rate offered over this sample
                p["schedule_s"] = max((r["at_s"] for r in p["rows"]), default=None)
                p["holds_slo"] = holds(p, slo_ms)
    analysis = analyze_rounds(rounds, slo_ms)
    analysis["agreement"] = agreement({name: runs[0] for name, runs in rounds.items()}, model_dir)
    analysis["stages"] = stage_breakdown(rounds)
    return analysis


# --- markdown ----------------------------------------------------------------------------------------------------


def _fmt(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _ci(slope: dict | None, digits: int = 2) -> str:
    if not slope:
        return "–"
    return f"{slope['slope']:.{digits}f} [{slope['ci_low']:.{digits}f}, {slope['ci_high']:.{digits}f}]"


def _has(results: dict, workload: str) -> bool:
    """Whether every engine ran ``workload`` (``--only`` runs a subset)."""
    return all(res.get(workload) is not None for res in results.values())


def video_table(results: dict, analysis: dict) -> str:
    """The video workloads side by side, the prompt-token check against vLLM's, and why a ratio is missing."""
    runs = {name: res["video"] for name, res in results.items() if res.get("video") is not None}
    if not runs:
        return ""
    ok = [v for v in runs.values() if "error" not in v]
    ns = sorted({int(n) for v in ok for n in v["cached"]["ttft_p50_by_n"]})
    clips = next((v["clips"] for v in ok), "")
    lines = [f"Video ({clips}; each a `video_url` data URL, sampled by `mm_processor_kwargs` and `media_io_kwargs` "
             "fps): N cached clips then a new question, one new clip per request, the live stream (a new segment "
             "per turn, the last few kept, the prompt rebuilt). Client TTFT p50, ms (round 1)", "",
             "| engine | " + " | ".join(f"cached N={n}" for n in ns) + " | slope ms/cached clip [95 % CI] | new clip | "
             "stream turn (window full) | prompt tokens cached N=" + (f"{ns[-1]}" if ns else "–") + " / new / stream "
             "turn |", "|---|" + "---:|" * (len(ns) + 4)]  # fmt: skip
    for name, v in runs.items():
        if "error" in v:
            lines.append(f"| {name} | failed: {v['error'][:300].replace('|', '/')} |" + " |" * (len(ns) + 3))
            continue
        by_n = {int(k): x for k, x in v["cached"]["ttft_p50_by_n"].items()}
        prompt = [r["prompt_tokens"] for r in v["cached"]["rows"] if ns and r["n"] == ns[-1]][:1]
        prompt += [r["prompt_tokens"] for r in v["new"]["rows"][:1]]
        prompt += [r["prompt_tokens"] for r in v["stream"]["rows"] if r["turn"] > v["stream"]["window"]][:1]
        lines.append(f"| {name} | " + " | ".join(_fmt(by_n.get(n), 1) for n in ns) + f" | {_ci(v['cached']['slope'])} "
                     f"| {_fmt(v['new']['ttft_p50_ms'], 1)} | {_fmt(v['stream']['ttft_p50_after_window_ms'], 1)} | "
                     f"{' / '.join(str(p) for p in prompt) or '–'} |")  # fmt: skip
    for name, check in (analysis.get("video_prompt_tokens") or {}).items():
        verdict = "equal" if check["ok"] else f"DIFFERENT on {len(check['mismatches'])}: {check['mismatches'][:3]}"
        lines += ["", f"Prompt tokens of {name}'s video requests against vLLM's: {verdict} ({check['compared']} "
                  "requests compared)"]  # fmt: skip
    for note in analysis.get("video_notes") or []:
        lines += ["", f"Video ratios: {note}"]
    return "\n".join(lines)


def tables(results: dict, analysis: dict) -> str:
    lines = []
    names = list(results)
    if _has(results, "cached"):
        lines += _cached_table(results, names)
    if _has(results, "new"):
        lines += _new_table(results, names)
    if _has(results, "load"):
        lines += _load_table(results, analysis, names)
        lines += ["", peer_tables.ladder(results, analysis)]
    if _has(results, "max"):
        lines += ["", peer_tables.closed_loop(results)]
    if _has(results, "burst"):
        lines += ["", peer_tables.burst(results)]
    if _has(results, "sliding"):
        lines += _sliding_table(results, names)
    video = video_table(results, analysis)
    if video:
        lines += ["", video]
    lines += ["", peer_tables.breakdown(results, analysis)]
    lines += ["", peer_tables.figures(analysis), "", peer_tables.ratios(analysis)]
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
    return "\n".join(lines).strip("\n")


def _cached_table(results: dict, names: list[str]) -> list[str]:
    lines = []
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
    return lines


def _new_table(results: dict, names: list[str]) -> list[str]:
    lines = []
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
    return lines


def _load_table(results: dict, analysis: dict, names: list[str]) -> list[str]:
    lines = []
    slo = analysis["slo_ttft_p99_ms"]
    lines += ["", f"Multi-turn chat under Poisson arrivals (SLO: p99 TTFT ≤ {slo:.0f} ms, and p99 of a "
              f"conversation's wait for its previous answer ≤ {slo:.0f} ms)", "",
              "| engine | rate /s | conv. | done | TTFT p50 | TTFT p99 | TPOT p50 | ITL p50 / p99 | req/s | "
              "out tok/s | conv. wait p99 | engine CPU s/req | holds |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name in names:
        for p in results[name]["load"]:
            conv, cpu = p.get("conversations", "–"), p.get("engine_cpu_s")
            if not p.get("completed"):
                lines.append(f"| {name} | {p['rate']:g} | {conv} | 0/{p['offered']} |" + " – |" * 9 + " no |")
                continue
            lines.append(
                f"| {name} | {p['rate']:g} | {conv} | {p['completed']}/{p['offered']} | {p['ttft_p50_ms']:.0f} | "
                f"{p['ttft_p99_ms']:.0f} | {_fmt(p['tpot_p50_ms'], 1)} | {_fmt(p['itl_p50_ms'], 1)} / "
                f"{_fmt(p['itl_p99_ms'], 1)} | {p['request_throughput']:.3f} | {p['output_token_throughput']:.1f} | "
                f"{p['conversation_wait_p99_ms']:.0f} | {_fmt(None if cpu is None else cpu / p['completed'], 3)} | "
                f"{'yes' if p['holds_slo'] else 'no'} |"
            )
    return lines


def _sliding_table(results: dict, names: list[str]) -> list[str]:
    lines = []
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
    return lines


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

    if not all(_has(results, w) for w in ("cached", "new", "load", "sliding")):
        return []  # --only ran a subset: the tables say it all
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
