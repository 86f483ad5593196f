"""The targets of ``make bench`` (benchmarks/run.py) next to what a run measured: one row per target, each with its
goal, the measured value and a status. The report (report.py) prints them first."""

from __future__ import annotations

ANCHOR = {"before_ms_per_image": 21.0, "after_ms_per_image": 2.9}  # vLLM #52040 / PR #52041, TP=4 GPUs, 31B
MODES = ("full", "strip", "lazy")


def _target(name: str, target: str, measured: str, ok: bool | None) -> dict:
    return {
        "name": name,
        "target": target,
        "measured": measured,
        "status": {True: "met", False: "MISSED", None: "not measured"}[ok],
    }


def targets(analysis: dict) -> list[dict]:
    """Every issue-7 target next to its measured value."""
    return [
        *_payload_targets(analysis),
        *_slope_targets(analysis),
        *_broadcast_and_step_targets(analysis),
        *_agreement_targets(analysis),
    ]


def _payload_targets(analysis: dict) -> list[dict]:
    """What cached images cost on the wire: payload bytes, metadata, deliveries per image."""
    rows, tables = [], analysis["cached_floor"]
    cached = [r for r in tables if r["scenario"] == "cached_floor" and r["mode"] in ("strip", "lazy")]
    if cached:
        worst = max(r["payload_bytes"] for r in cached)
        rows.append(
            _target(
                "strip/lazy: payload bytes of fully cached images",
                "0 B",
                f"max {worst:.0f} B per request over {len(cached)} configurations",
                worst == 0,
            )
        )
        meta = max(r["metadata_per_image_rank"] for r in cached)
        rows.append(
            _target("strip/lazy: metadata per cached image per rank", "≤ 256 B", f"max {meta:.0f} B", meta <= 256)
        )
    else:
        rows.append(_target("strip/lazy: payload bytes of fully cached images", "0 B", "–", None))
    lazy_turns = [t for t in analysis["turns"] if t["mode"] == "lazy" and t["scenario"] == "sliding_window"]
    dup = [r for r in analysis["duplicate_warm"] if r["mode"] == "lazy"]
    if lazy_turns or dup:
        worst_sw = max((t["deliveries_per_image_rank"] for t in lazy_turns), default=0.0)
        worst_dup = max((r["deliveries_per_image_rank"] for r in dup), default=0.0)
        rows.append(_target("lazy: payload deliveries per distinct image per rank (sliding window, duplicate)",
                            "≤ 1", f"sliding window {worst_sw:.2f}, duplicate {worst_dup:.2f}" +
                            ("" if dup else " (duplicate not run)"), max(worst_sw, worst_dup) <= 1.0))  # fmt: skip
    return rows


def _slope_targets(analysis: dict) -> list[dict]:
    """The TTFT slopes against the number of cached images."""
    rows, sl = [], analysis["slopes"]
    for client, limit in (("sdk", 0.1), ("resend", 0.5)):
        hits = [
            s
            for s in sl
            if (s["scenario"], s["mode"], s["client"]) == ("cached_floor", "lazy", client) and s["image_specific"]
        ]
        if not hits:
            rows.append(_target(f"lazy image-specific TTFT slope, {client} client", f"≤ {limit} ms/image", "–", None))
            continue
        text = "; ".join(
            f"TP{s['tp']}: {s['image_specific']['slope']:+.3f} ms "
            f"[{s['image_specific']['ci_low']:+.3f}, {s['image_specific']['ci_high']:+.3f}]"
            for s in hits
        )
        ok = all(s["image_specific"]["slope"] <= limit for s in hits)
        rows.append(
            _target(
                f"lazy image-specific TTFT slope (images − text control), {client} client",
                f"≤ {limit} ms/image (point estimate; 95 % CI shown)",
                text,
                ok,
            )
        )
    for mode in MODES:
        hits = [s for s in sl if (s["scenario"], s["mode"], s["client"]) == ("cached_floor", mode, "sdk")]
        if hits:
            text = "; ".join(
                f"TP{s['tp']}: {s['images']['slope']:.3f} ms [{s['images']['ci_low']:.3f}, "
                f"{s['images']['ci_high']:.3f}]"
                for s in hits
            )
            ok = all(s["images"]["ci_low"] > 0 for s in hits) if mode == "full" else None
            rows.append(_target(f"total TTFT slope, {mode} (anchor: {ANCHOR['before_ms_per_image']} before, "
                                f"{ANCHOR['after_ms_per_image']} after)", "full grows linearly (CI above 0)"
                                if mode == "full" else "reported", text, ok))  # fmt: skip
    return rows


def _broadcast_and_step_targets(analysis: dict) -> list[dict]:
    """full's per-image broadcast against the floors; the scheduler's step time against items held."""
    rows = []
    for b in analysis["broadcast"]:
        ok = b["ratio_to_grpc"] is not None and b["ratio_to_grpc"] <= 1.5
        rows.append(_target(f"full per-image broadcast, TP{b['tp']} (full − strip slope)", "≤ 1.5× gRPC floor",
                            f"{b['per_image_ms']:.2f} ms = {ratio_text(b['ratio_to_grpc'])} gRPC floor "
                            f"({ms_text(b['grpc_floor_ms'])} ms), {ratio_text(b['ratio_to_shm'])} shm floor "
                            f"({ms_text(b['shm_floor_ms'])} ms)", ok))  # fmt: skip
    steps = analysis.get("scheduler_steps")
    if steps:
        for mode, v in steps["modes"].items():
            rows.append(_target(f"scheduler decode-step time flat, {mode}, {steps['counts'][0]}→{steps['counts'][-1]} "
                                "items", "±20 %, items examined bounded",
                                f"max deviation {v['flatness'] * 100:.1f} % (p50 {v['rows'][0]['decode_p50_us']:.1f} → "
                                f"{v['rows'][-1]['decode_p50_us']:.1f} µs), items examined ≤ {v['items_examined_max']}",
                                v["flatness"] <= 0.2 and v["items_examined_max"] <= 16))  # fmt: skip
    return rows


def _agreement_targets(analysis: dict) -> list[dict]:
    """New images, videos, token equality across modes, byte counters against the ranks'."""
    rows = []
    eq = analysis["equality"]
    rows += analysis.get("new_images", {}).get("targets", [])
    rows += (analysis.get("videos") or {}).get("targets", [])
    rows.append(
        _target(
            "all modes return the same tokens",
            "no mismatch",
            f"{eq['checked']} comparisons, {len(eq['mismatches'])} mismatches (across TP sizes, "
            f"informational: {eq['cross_tp_agree']}/{eq['cross_tp_compared']} agree)",
            eq["ok"],
        )
    )
    xc = analysis["crosscheck"]
    rows.append(
        _target(
            "scheduler byte counters = workers' received bytes",
            "equal",
            f"{xc['requests']} requests, {len(xc['mismatches'])} mismatches",
            xc["ok"],
        )
    )
    return rows


def ratio_text(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def ms_text(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"
