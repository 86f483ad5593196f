"""Markdown tables of ``benchmarks/peer/compare.py``'s capacity workloads, the TTFT breakdown and the medians of every figure
and ratio over the rounds (the single-request tables are ``peer_report.tables``'). ``results``: engine -> round 1."""

from __future__ import annotations

from benchmarks.peer import peer_stages


def _fmt(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _spread(value, sp, digits: int = 2) -> str:
    if value is None or not sp or sp[0] is None or sp[0] == sp[1]:
        return _fmt(value, digits)
    return f"{_fmt(value, digits)} [{_fmt(sp[0], digits)}–{_fmt(sp[1], digits)}]"


def _rate(x) -> str:
    return "none" if x is None else f"{x:g}/s"


def ladder(results: dict, analysis: dict) -> str:
    rounds = analysis.get("rounds", 1)
    lines = [f"The SLO ladder: offered rates in turn until one fails the SLO (medians of {rounds} round(s) "
             "[min–max] where more)", "",
             "| engine | highest rate held | req/s there | first rate failed | stopped (round 1) |",
             "|---|---:|---:|---:|---|"]  # fmt: skip
    for name in results:
        f, sp = analysis["figures"].get(name, {}), analysis.get("spread", {}).get(name, {})
        fail = f.get("first_failing_rate")
        stopped = (results[name].get("ladder") or {}).get("stopped", "–")
        fail_text = _rate(fail) if fail is not None else f"none up to {_rate(f.get('highest_rate_offered'))}"
        lines.append(f"| {name} | {_spread(f.get('rate_at_slo'), sp.get('rate_at_slo'), 2)} | "
                     f"{_spread(f.get('throughput_at_slo'), sp.get('throughput_at_slo'), 3)} | {fail_text} | "
                     f"{stopped} |")  # fmt: skip
    return "\n".join(lines)


def closed_loop(results: dict) -> str:
    lines = ["Closed loop: every request sent at once (round 1); TTFT spread = max − min", "",
             "| engine | images | done | req/s | out tok/s | TTFT p50 | TTFT p99 | TTFT spread | TPOT p50 | ITL p99 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for name, res in results.items():
        for variant, m in (res.get("max") or {}).items():
            if not m.get("completed"):
                lines.append(f"| {name} | {variant} | 0/{m.get('requests')} |" + " – |" * 7)
                continue
            lines.append(
                f"| {name} | {variant} | {m['completed']}/{m['requests']} | {m['request_throughput']:.2f} | "
                f"{m['output_token_throughput']:.1f} | {m['ttft_p50_ms']:.0f} | {m['ttft_p99_ms']:.0f} | "
                f"{m['ttft_spread_ms']:.0f} | {_fmt(m['tpot_p50_ms'], 1)} | {_fmt(m['itl_p99_ms'], 1)} |"
            )
    return "\n".join(lines)


def burst(results: dict) -> str:
    lines = ["A burst of new-image requests while conversations decode (round 1): the decodes' inter-token gaps "
             "that end between the burst's send and its last first token (the burst window), each decode's longest "
             "stall (its longest gap overlapping the window) with its p50 and max over the decodes, and the burst's "
             "TTFT. An engine that delivers the tokens produced during a stall in one bunch has one long gap and "
             "many of ~0 ms, so its gap p50/p99 read near zero while its decodes waited as long as the long gap: "
             "the longest stall compares both engines alike.", "",
             "| engine | decodes × tokens | burst | decode ITL p50 / p99 / max in the burst | longest stall per "
             "decode p50 / max | decode ITL p99, whole | burst TTFT p50 / p99 | burst TTFT spread | burst window s "
             "| decodes outlasted it |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for name, res in results.items():
        b = res.get("burst")
        if not b:
            continue
        if not b.get("completed"):
            lines.append(f"| {name} | {b['decodes']} × {b['decode_tokens']} | 0/{b['requests']} |" + " – |" * 7)
            continue
        lines.append(
            f"| {name} | {b['decodes']} × {b['decode_tokens']} | {b['completed']}/{b['requests']} | "
            f"{_fmt(b['decode_itl_p50_in_burst_ms'], 1)} / {_fmt(b['decode_itl_p99_in_burst_ms'], 1)} / "
            f"{_fmt(b['decode_itl_max_in_burst_ms'], 1)} | {_fmt(b.get('decode_stall_p50_ms'), 1)} / "
            f"{_fmt(b.get('decode_stall_max_ms'), 1)} | {_fmt(b['decode_itl_p99_ms'], 1)} | "
            f"{b['ttft_p50_ms']:.0f} / {b['ttft_p99_ms']:.0f} | {b['ttft_spread_ms']:.0f} | "
            f"{b['burst_window_s']:.2f} | {'yes' if b['decodes_outlasted_burst'] else 'no'} |"
        )
    return "\n".join(lines)


def breakdown(results: dict, analysis: dict) -> str:
    """The stage table beside vLLM's client TTFT of the same workload (``peer_stages.markdown``)."""
    figures = analysis["figures"]
    columns, vllm = [], []
    for name, by_workload in (analysis.get("stages") or {}).items():
        for label, key in (("cached", "cached_n2_ttft_p50_ms"), ("new", "new_n1_ttft_p50_ms"),
                           ("sliding", "sliding_ttft_mean_after_window_ms")):  # fmt: skip
            got = by_workload.get(label) or {}
            columns.append((f"{name} {label} N={got.get('n')}", got.get("stages"), figures.get(name, {}).get(key)))
            vllm.append(figures.get("vllm", {}).get(key))
    return peer_stages.markdown(columns, vllm)


def figures(analysis: dict) -> str:
    """Every figure per engine, median over the rounds [min–max]."""
    names = list(analysis["figures"])
    keys = list(dict.fromkeys(k for n in names for k in analysis["figures"][n]))
    lines = [f"Every figure, median of {analysis.get('rounds', 1)} round(s) [min–max] (ms, req/s, tok/s, s)", "",
             "| figure | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]  # fmt: skip
    for k in keys:
        cells = [_spread(analysis["figures"][n].get(k), analysis.get("spread", {}).get(n, {}).get(k), 3) for n in names]
        lines.append(f"| `{k}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratios(analysis: dict) -> str:
    lines = [f"| ratio (mmcast / vLLM), median of {analysis.get('rounds', 1)} round(s) [min–max] | value |",
             "|---|---:|"]  # fmt: skip
    sp = analysis.get("ratio_spread", {})
    lines += [f"| `{k}` | {_spread(v, sp.get(k))} |" for k, v in analysis["ratios"].items()]
    return "\n".join(lines)
