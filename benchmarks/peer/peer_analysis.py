"""Figures, ratios mmcast / vLLM and goals of ``benchmarks/peer/compare.py``, over one round (quick) or several (full).

Every engine's run (one round) is reduced to flat figures (``run_figures``), so rounds combine the same way for
every figure: the median, with the spread min–max beside it (``aggregate``). A ratio is computed round by round
(round i of mmcast over round i of vLLM: the rounds run in turn, engine after engine, so round i of both shares
the machine's state of that time) and reported as the median of the rounds' ratios with their min–max, so one
run's noise shows as a wide spread instead of a verdict. Goals are judged on the medians.

Ratios: for latencies, slopes, CPU seconds lower is better; for throughput higher is better. The TPOT ratio is the
load workload's at the ladder's first rate (both engines always run it, lightly loaded); the CPU ratio is the sum
over the offered rates both engines ran of their engine CPU seconds per request (``cpu_s_per_request_ratio``),
per rate beside it (``_at_<rate>``).

Video (``peer_workloads.video``): ``video_cached_slope_ratio`` (TTFT slope per cached clip),
``video_new_clip_ttft_ratio`` (TTFT p50 of a request with one new clip), ``video_stream_turn_ttft_ratio`` (TTFT p50
of a live-stream turn after the window filled). They compare like with like only when both engines sampled the same
frames, so every video request's prompt token count must be vLLM's (``video_prompt_tokens``); where it is not, or
where an engine's video workload failed or did not run, that engine's video ratios are left out and
``video_notes`` says why (never a number made up).
"""

from __future__ import annotations

from benchmarks.peer.peer_capacity import first_failing_rate, holds
from benchmarks.support import stats

TIE_TOLERANCE = 0.01  # at one offered rate, both engines' req/s differ by when the last answer lands, not capacity

# (ratio, the figure it divides); a TP size's suffix ("_tp2") is added to the ratio's name
RATIOS = (
    ("cached_ttft_slope_ratio", "cached_ttft_slope_ms"),
    ("new_image_ttft_ratio", "new_image_ttft_slope_ms"),
    ("throughput_at_slo_ratio", "throughput_at_slo"),
    ("sliding_ttft_ratio", "sliding_ttft_mean_after_window_ms"),
    ("cached_n2_ttft_ratio", "cached_n2_ttft_p50_ms"),
    ("new_n1_ttft_ratio", "new_n1_ttft_p50_ms"),
    ("tpot_ratio", "tpot_p50_ms"),
    ("max_throughput_ratio_new", "max_new_request_throughput"),
    ("max_throughput_ratio_cached", "max_cached_request_throughput"),
    ("burst_itl_p99_ratio", "burst_decode_itl_p99_ms"),
    ("burst_stall_p50_ratio", "burst_decode_stall_p50_ms"),
    ("burst_stall_max_ratio", "burst_decode_stall_max_ms"),
    ("video_cached_slope_ratio", "video_cached_ttft_slope_ms"),
    ("video_new_clip_ttft_ratio", "video_new_clip_ttft_p50_ms"),
    ("video_stream_turn_ttft_ratio", "video_stream_turn_ttft_p50_ms"),
)
VIDEO_RATIOS = tuple(name for name, _ in RATIOS if name.startswith("video_"))
_MAX_KEYS = ("request_throughput", "output_token_throughput", "ttft_p50_ms", "ttft_p99_ms", "ttft_spread_ms",
             "tpot_p50_ms", "itl_p99_ms")  # fmt: skip
CPU_PREFIX = "cpu_s_per_request_at_"


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b; None without both or for b ≤ 0 (only a slope can be: vLLM's cached slope on a noisy machine, where
    a ratio would read as a verdict it is not)."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _by_n(by_n: dict, n: int):
    return by_n.get(n, by_n.get(str(n)))  # int keys in memory, str keys once through JSON


def _slope(result: dict | None) -> float | None:
    return ((result or {}).get("slope") or {}).get("slope")


def at_slo(points: list[dict], slo_ms: float) -> dict:
    """The highest offered rate held, and the request throughput measured there (0 when none is held)."""
    held = [p for p in points if holds(p, slo_ms)]
    if not held:
        return {"rate": None, "request_throughput": 0.0}
    best = max(held, key=lambda p: p["rate"])
    return {"rate": best["rate"], "request_throughput": best["request_throughput"],
            "output_token_throughput": best["output_token_throughput"]}  # fmt: skip


def run_figures(res: dict, slo_ms: float) -> dict:
    """One engine's round as flat figures (None where the round has no such workload)."""
    f: dict = {}
    cached = res.get("cached") or {}
    f["cached_ttft_slope_ms"] = _slope(cached)
    f["cached_n2_ttft_p50_ms"] = _by_n(cached.get("ttft_p50_by_n", {}), 2)
    for size, r in (res.get("new") or {}).items():
        f["new_image_ttft_slope_ms" + ("" if size == "448x448" else f"_{size}")] = _slope(r)
    f["new_n1_ttft_p50_ms"] = _by_n(((res.get("new") or {}).get("448x448") or {}).get("ttft_p50_by_n", {}), 1)
    f["sliding_ttft_mean_after_window_ms"] = (res.get("sliding") or {}).get("ttft_mean_after_window_ms")
    points = res.get("load") or []
    best = at_slo(points, slo_ms)
    f["rate_at_slo"] = best["rate"]
    f["throughput_at_slo"] = best["request_throughput"]
    f["first_failing_rate"] = first_failing_rate(points, slo_ms)
    f["highest_rate_offered"] = max((p["rate"] for p in points), default=None)
    first = points[0] if points else {}  # the ladder's first rate: every engine runs it (a rate below it not)
    f["tpot_p50_ms"] = first.get("tpot_p50_ms")
    f["ttft_p50_ms_at_first_rate"] = first.get("ttft_p50_ms")
    for p in points:
        if p.get("completed") and p.get("engine_cpu_s") is not None:
            f[f"{CPU_PREFIX}{p['rate']:g}"] = p["engine_cpu_s"] / p["completed"]
    for variant in ("new", "cached"):
        m = (res.get("max") or {}).get(variant) or {}
        for key in _MAX_KEYS:
            f[f"max_{variant}_{key}"] = m.get(key)
    v = res.get("video") or {}
    f["video_cached_ttft_slope_ms"] = _slope(v.get("cached"))
    f["video_cached_n1_ttft_p50_ms"] = _by_n((v.get("cached") or {}).get("ttft_p50_by_n", {}), 1)
    f["video_new_clip_ttft_p50_ms"] = (v.get("new") or {}).get("ttft_p50_ms")
    f["video_stream_turn_ttft_p50_ms"] = (v.get("stream") or {}).get("ttft_p50_after_window_ms")
    b = res.get("burst") or {}
    f["burst_decode_itl_p99_ms"] = b.get("decode_itl_p99_in_burst_ms")
    f["burst_decode_itl_p99_whole_ms"] = b.get("decode_itl_p99_ms")
    f["burst_decode_stall_p50_ms"] = b.get("decode_stall_p50_ms")
    f["burst_decode_stall_max_ms"] = b.get("decode_stall_max_ms")
    for key in ("ttft_p50_ms", "ttft_p99_ms", "ttft_spread_ms"):
        f[f"burst_{key}"] = b.get(key)
    f["burst_window_s"] = b.get("burst_window_s")
    return f


def aggregate(values: list[float | None]) -> dict:
    """Median and min–max of one figure over rounds (rounds without it left out; median None if none has it)."""
    xs = [x for x in values if x is not None]
    if not xs:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": stats.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def combine(rounds: list[dict]) -> tuple[dict, dict]:
    """Per key of flat dicts, one per round: (medians, {key: [min, max]})."""
    keys = list(dict.fromkeys(k for r in rounds for k in r))
    agg = {k: aggregate([r.get(k) for r in rounds]) for k in keys}
    return {k: a["median"] for k, a in agg.items()}, {k: [a["min"], a["max"]] for k, a in agg.items()}


def round_ratios(m: dict, v: dict, suffix: str = "") -> dict:
    """mmcast's figures over vLLM's, one round."""
    out = {name + suffix: _ratio(m.get(key), v.get(key)) for name, key in RATIOS}
    for key in m:
        if key.startswith("new_image_ttft_slope_ms_"):
            out[f"new_image_ttft_ratio_{key.removeprefix('new_image_ttft_slope_ms_')}{suffix}"] = _ratio(
                m[key], v.get(key)
            )
    common = [k for k in m if k.startswith(CPU_PREFIX) and v.get(k) is not None and m[k] is not None]
    out["cpu_s_per_request_ratio" + suffix] = (
        _ratio(sum(m[k] for k in common), sum(v[k] for k in common)) if common else None
    )
    for k in common:
        out[f"cpu_s_per_request_ratio_at_{k.removeprefix(CPU_PREFIX)}{suffix}"] = _ratio(m[k], v[k])
    return out


def _video_rows(res: dict) -> dict[str, int]:
    """Prompt tokens of every video request of one round, by request key."""
    v = res.get("video") or {}
    rows = [*(v.get("cached") or {}).get("rows", []), *(v.get("new") or {}).get("rows", []),
            *(v.get("stream") or {}).get("rows", [])]  # fmt: skip
    return {r["key"]: r["prompt_tokens"] for r in rows if "key" in r}


def video_prompt_tokens(rounds: dict[str, list[dict]]) -> dict:
    """Per mmcast engine: its video requests' prompt token counts against vLLM's, request by request over the rounds
    both ran (equal counts: the same frames sampled, the same grid). Engines without video rows on either side are
    left out (``video_notes`` says why)."""
    out = {}
    ref_runs = rounds.get("vllm") or []
    for name, runs in rounds.items():
        if name == "vllm":
            continue
        compared, mismatches = 0, []
        for mine, ref in zip(runs, ref_runs, strict=False):
            a, b = _video_rows(mine), _video_rows(ref)
            for key in sorted(set(a) & set(b)):
                compared += 1
                if a[key] != b[key]:
                    mismatches.append({"key": key, name: a[key], "vllm": b[key]})
        if compared:
            out[name] = {"compared": compared, "mismatches": mismatches[:10], "ok": not mismatches}
    return out


def video_notes(rounds: dict[str, list[dict]], checks: dict) -> list[str]:
    """Why video ratios are missing, engine by engine (empty when every one could be computed)."""
    notes = []
    ran = {name: [r.get("video") for r in runs] for name, runs in rounds.items()}
    if "vllm" not in rounds:
        return ["vLLM did not run (--engines): no video ratio"] if any(any(v) for v in ran.values()) else []
    for name, videos in ran.items():
        for i, v in enumerate(videos):
            if v is None:
                notes.append(f"{name} round {i + 1}: the video workload did not run (--only, or a plan without it)")
            elif "error" in v:
                notes.append(f"{name} round {i + 1}: the video workload failed: {v['error']}")
    for name, check in checks.items():
        if not check["ok"]:
            first = check["mismatches"][0]
            notes.append(f"{name}: prompt tokens differ from vLLM's on {len(check['mismatches'])} of "
                         f"{check['compared']} video requests (first {first['key']}: {first[name]} vs "
                         f"{first['vllm']}): the engines sampled different frames, so its video ratios are left "
                         "out")  # fmt: skip
    return notes


def suffix_of(name: str) -> str:
    return "" if name == "mmcast_tp1" else f"_{name.removeprefix('mmcast_')}"


def analyze_rounds(rounds: dict[str, list[dict]], slo_ms: float) -> dict:
    """``rounds``: engine -> its rounds' results. Figures, spreads, ratios (medians over rounds), their spreads,
    and the goals."""
    per_round = {name: [run_figures(r, slo_ms) for r in runs] for name, runs in rounds.items()}
    figures, spread = {}, {}
    for name, figs in per_round.items():
        figures[name], spread[name] = combine(figs)
    ratios, ratio_spread = {}, {}
    checks = video_prompt_tokens(rounds)
    if "vllm" in per_round:
        for name in (n for n in per_round if n != "vllm"):
            pairs = list(zip(per_round[name], per_round["vllm"], strict=False))
            med, sp = combine([round_ratios(m, v, suffix_of(name)) for m, v in pairs])
            if not checks.get(name, {}).get("ok", False):  # no like-for-like video requests: no video ratio
                for key in VIDEO_RATIOS:
                    med[key + suffix_of(name)], sp[key + suffix_of(name)] = None, [None, None]
            ratios.update(med)
            ratio_spread.update(sp)
    n_rounds = max((len(r) for r in rounds.values()), default=0)
    return {
        "rounds": n_rounds,
        "figures": figures,
        "spread": spread,
        "ratios": ratios,
        "ratio_spread": ratio_spread,
        "goals": goals(figures, ratios, ratio_spread if n_rounds > 1 else {}),
        "slo_ttft_p99_ms": slo_ms,
        "video_prompt_tokens": checks,
        "video_notes": video_notes(rounds, checks),
    }


def throughput_held(mmcast: dict, vllm: dict) -> bool:
    """mmcast holds at least vLLM's throughput at the SLO: a higher rate held, or the same offered rate held with
    req/s within ``TIE_TOLERANCE`` (a Poisson schedule's achieved rate is its arrivals' over the run's span, so
    two engines that serve every request of the same schedule tie up to the last answer's time)."""
    if mmcast.get("rate") is None or vllm.get("rate") is None:
        return mmcast.get("rate") is not None
    if mmcast["rate"] != vllm["rate"]:
        return mmcast["rate"] > vllm["rate"]
    return mmcast["request_throughput"] >= (1 - TIE_TOLERANCE) * vllm["request_throughput"]


def _fmt(x, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _with_spread(value, sp, digits: int = 2) -> str:
    if value is None or not sp or sp[0] is None or sp[0] == sp[1]:
        return _fmt(value, digits)
    return f"{_fmt(value, digits)} [{_fmt(sp[0], digits)}–{_fmt(sp[1], digits)}]"


# (goal, ratio, limit, beyond (None: none), the figure it divides, unit); "<=" goals are lower-is-better
_LOWER = (
    ("cached N=2 TTFT p50 ≤ 1.0× vLLM's", "cached_n2_ttft_ratio", 1.0, "cached_n2_ttft_p50_ms", "ms"),
    ("new-image N=1 TTFT p50 ≤ 1.0× vLLM's", "new_n1_ttft_ratio", 1.0, "new_n1_ttft_p50_ms", "ms"),
    ("sliding-window TTFT ≤ 1.0× vLLM's", "sliding_ttft_ratio", 1.0, "sliding_ttft_mean_after_window_ms", "ms"),
    ("TPOT p50 (load, first rate) ≤ 1.0× vLLM's", "tpot_ratio", 1.0, "tpot_p50_ms", "ms"),
    ("cached-image TTFT slope ≤ 0.5× vLLM's", "cached_ttft_slope_ratio", 0.5, "cached_ttft_slope_ms", "ms/image"),
    ("TTFT slope per new 448x448 image ≤ 1.0× vLLM's", "new_image_ttft_ratio", 1.0, "new_image_ttft_slope_ms",
     "ms/image"),
    ("burst: running decodes' ITL p99 ≤ 1.0× vLLM's", "burst_itl_p99_ratio", 1.0, "burst_decode_itl_p99_ms", "ms"),
    ("burst: a decode's longest stall, max over the decodes ≤ 1.0× vLLM's", "burst_stall_max_ratio", 1.0,
     "burst_decode_stall_max_ms", "ms"),
    ("video: TTFT slope per cached clip ≤ 1.0× vLLM's", "video_cached_slope_ratio", 1.0,
     "video_cached_ttft_slope_ms", "ms/clip"),
    ("video: TTFT p50 of one new clip ≤ 1.0× vLLM's", "video_new_clip_ttft_ratio", 1.0, "video_new_clip_ttft_p50_ms",
     "ms"),
    ("video: live-stream turn TTFT p50 (window full) ≤ 1.0× vLLM's", "video_stream_turn_ttft_ratio", 1.0,
     "video_stream_turn_ttft_p50_ms", "ms"),
)  # fmt: skip
_HIGHER = (
    ("closed-loop max throughput, new images ≥ 1.0× vLLM's (beyond: 1.2×)", "max_throughput_ratio_new", 1.0, 1.2,
     "max_new_request_throughput", "req/s"),
    ("closed-loop max throughput, cached image ≥ 1.0× vLLM's (beyond: 1.2×)", "max_throughput_ratio_cached", 1.0,
     1.2, "max_cached_request_throughput", "req/s"),
)  # fmt: skip


def _per_s(x) -> str:
    return "none" if x is None else f"{x:g}/s"


def _rate(figs: dict) -> str:
    """Throughput at the SLO with the rate held and the rate failed first (or the ladder's top, none failed)."""
    fail = figs.get("first_failing_rate")
    first = (
        f"first failed {_per_s(fail)}"
        if fail is not None
        else f"none failed up to {_per_s(figs.get('highest_rate_offered'))}"
    )
    return f"{_fmt(figs.get('throughput_at_slo'), 3)} req/s at {_per_s(figs.get('rate_at_slo'))} held, {first}"


def goals(figures: dict, ratios: dict, ratio_spread: dict | None = None) -> list[dict]:
    out = []
    sp = ratio_spread or {}
    m, v = figures.get("mmcast_tp1", {}), figures.get("vllm", {})

    def goal(name: str, ok: bool | None, measured: str, beyond: bool = False) -> None:
        status = "n/a" if ok is None else ("met" if ok else "missed")
        out.append({"name": "TP1 " + name, "status": status + (" (beyond)" if ok and beyond else ""),
                    "measured": measured})  # fmt: skip

    def others(key: str) -> str:
        more = [f"{k.removeprefix(key + '_')} {_with_spread(ratios[k], sp.get(k))}" for k in ratios
                if k.startswith(key + "_tp") and k.count("_at_") == key.count("_at_")]  # fmt: skip
        return ("; " + ", ".join(more)) if more else ""

    for name, key, limit, fig, unit in _LOWER:
        r = ratios.get(key)
        goal(name, None if r is None else r <= limit,
             f"ratio {_with_spread(r, sp.get(key))} ({_fmt(m.get(fig))} vs {_fmt(v.get(fig))} {unit}){others(key)}")  # fmt: skip
    for name, key, limit, beyond, fig, unit in _HIGHER:
        r = ratios.get(key)
        goal(name, None if r is None else r >= limit,
             f"ratio {_with_spread(r, sp.get(key))} ({_fmt(m.get(fig))} vs {_fmt(v.get(fig))} {unit}){others(key)}",
             beyond=r is not None and r >= beyond)  # fmt: skip
    r = ratios.get("throughput_at_slo_ratio")
    held = None
    if m and v and (m.get("highest_rate_offered") is not None or v.get("highest_rate_offered") is not None):
        held = throughput_held({"rate": m.get("rate_at_slo"), "request_throughput": m.get("throughput_at_slo")},
                               {"rate": v.get("rate_at_slo"), "request_throughput": v.get("throughput_at_slo")})  # fmt: skip
    goal("request throughput at the SLO ≥ 1.0× vLLM's", held,
         f"ratio {_with_spread(r, sp.get('throughput_at_slo_ratio'))} (mmcast {_rate(m)}; vLLM {_rate(v)})"
         f"{others('throughput_at_slo_ratio')}")  # fmt: skip
    r = ratios.get("cpu_s_per_request_ratio")
    at = [f"{k.removeprefix('cpu_s_per_request_ratio_at_')}/s {_fmt(x)}" for k, x in ratios.items()
          if k.startswith("cpu_s_per_request_ratio_at_") and not k.split("_at_")[1].count("_tp")]  # fmt: skip
    goal("engine CPU s per request at the offered rates ≤ 0.5× vLLM's", None if r is None else r <= 0.5,
         f"ratio {_with_spread(r, sp.get('cpu_s_per_request_ratio'))} (per rate: {', '.join(at) or '–'})"
         f"{others('cpu_s_per_request_ratio')}")  # fmt: skip
    t1, t2 = figures.get("mmcast_tp1"), figures.get("mmcast_tp2")
    if t1 and t2:
        keys = (("cached slope", "cached_ttft_slope_ms"), ("new-image slope", "new_image_ttft_slope_ms"),
                ("sliding TTFT", "sliding_ttft_mean_after_window_ms"))  # fmt: skip
        measured = all(t1.get(k) is not None and t2.get(k) is not None for _, k in keys)  # --only may leave out
        ok = measured and all(t2[k] <= t1[k] for _, k in keys)
        out.append({"name": "TP2 no worse than TP1 per request", "status": "n/a" if not measured else
                    "met" if ok else "missed",
                    "measured": "; ".join(f"{n} TP2/TP1 {_fmt(_ratio(t2.get(k), t1.get(k)))}" for n, k in keys)})  # fmt: skip
    return out
