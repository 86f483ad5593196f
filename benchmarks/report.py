"""From request records to figures: per-configuration tables, slopes, the issue-7 targets, Markdown and plots.

``analyze`` is pure (records in, dict out) so it can be tested on synthetic records; ``write_markdown`` and
``write_plots`` render its result. Plots need matplotlib; without it they are skipped and the Markdown says so.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterable, Sequence

from benchmarks.affinity import sdk_balancing as affinity
from benchmarks.http_api import http_overhead
from benchmarks.report_targets import ms_text, ratio_text, targets
from benchmarks.support import stats
from benchmarks.transfer import new_images, videos

_TIMED = ("image", "control")


def _group(records: Iterable[dict], *keys: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = collections.defaultdict(list)
    for r in records:
        out[tuple(r[k] for k in keys)].append(r)
    return dict(out)


def _ms_slope(rows: Sequence[dict]) -> stats.Slope | None:
    if len({r["n"] for r in rows}) < 2 or len(rows) < 3:
        return None
    return stats.fit_slope([r["n"] for r in rows], [r["ttft_ms"] for r in rows])


_REQUEST = ("tp", "scenario", "kind", "client", "n", "index", "image")  # one request, whatever served it


def _config(r: dict) -> str:
    """What served a record: the new-image variant (payload encoding + placement), else the transfer mode."""
    return r.get("variant") or r["mode"]


def _request_key(records: Iterable[dict], *keys: str) -> dict[tuple, list[dict]]:
    return _group(({**r, "image": r.get("image", "")} for r in records), *keys)


def mode_equality(records: Sequence[dict]) -> dict:
    """Every request (tp, scenario, kind, client, n, index, image) must have produced the same tokens in every
    configuration that ran it: transfer mode, or new-image variant."""
    checked, mismatches = 0, []
    for key, rows in _request_key(records, *_REQUEST).items():
        if key[1] == "calibration":
            continue
        by_mode = {_config(r): tuple(r["token_ids"]) for r in rows}
        if len(by_mode) < 2:
            continue
        checked += 1
        if len(set(by_mode.values())) > 1:
            mismatches.append({"key": dict(zip(_REQUEST, key, strict=True)),
                               "tokens": {m: list(t) for m, t in by_mode.items()}})  # fmt: skip
    # Across tensor-parallel sizes tokens may legitimately differ (reduction order), so this is only reported.
    cross, agree = 0, 0
    for key, rows in _request_key(({**r, "config": _config(r)} for r in records), *_REQUEST[1:], "config").items():
        by_tp = {r["tp"]: tuple(r["token_ids"]) for r in rows}
        if key[0] != "calibration" and len(by_tp) > 1:
            cross += 1
            agree += len(set(by_tp.values())) == 1
    return {
        "checked": checked,
        "mismatches": mismatches,
        "ok": checked > 0 and not mismatches,
        "cross_tp_compared": cross,
        "cross_tp_agree": agree,
    }


def byte_crosscheck(records: Sequence[dict]) -> dict:
    """Scheduler-side bytes written (summed over ranks) against the workers' received bytes, per kind."""
    bad = []
    for r in records:
        m = r["metrics"]
        for kind in ("payload", "metadata"):
            if m[f"{kind}_bytes"] != m[f"worker_{kind}_bytes"]:
                bad.append({"scenario": r["scenario"], "tp": r["tp"], "mode": r["mode"], "n": r["n"],
                            "index": r["index"], "kind": kind, "scheduler": m[f"{kind}_bytes"],
                            "workers": m[f"worker_{kind}_bytes"]})  # fmt: skip
    return {"requests": len(records), "mismatches": bad, "ok": not bad}


def cached_floor_tables(records: Sequence[dict]) -> list[dict]:
    """One row per (scenario, tp, mode, client, n): TTFT p50/p90, the control's, bytes per request."""
    rows = []
    timed = [r for r in records if r["scenario"] in ("cached_floor", "duplicate") and r["kind"] in _TIMED]
    controls = _group([r for r in timed if r["kind"] == "control"], "scenario", "tp", "mode", "n")
    for (scenario, tp, mode, client, n), rs in sorted(_group([r for r in timed if r["kind"] == "image"], "scenario",
                                                            "tp", "mode", "client", "n").items()):  # fmt: skip
        t = stats.summary([r["ttft_ms"] for r in rs])
        ctrl = controls.get((scenario, tp, mode, n), [])
        c = stats.summary([r["ttft_ms"] for r in ctrl]) if ctrl else None

        def med(key: str, rs: list[dict] = rs) -> float:
            return stats.median([r["metrics"][key] for r in rs])

        rows.append({
            "scenario": scenario, "tp": tp, "mode": mode, "client": client, "n": n, "repeats": len(rs),
            "ttft_p50_ms": t["p50"], "ttft_p90_ms": t["p90"],
            "control_p50_ms": c["p50"] if c else None, "control_p90_ms": c["p90"] if c else None,
            "payload_bytes": med("payload_bytes"), "metadata_bytes": med("metadata_bytes"),
            "control_bytes": med("control_bytes"), "saved_bytes": med("saved_prefix_bytes") + med("saved_rank_bytes"),
            "metadata_per_image_rank": med("metadata_bytes") / (n * tp) if n else 0.0,
            "step_ms_mean": sum(r["metrics"]["step_seconds_sum"] for r in rs) * 1e3
            / max(1, sum(r["metrics"]["steps"] for r in rs)),
            "prompt_tokens": rs[0]["usage"]["prompt_tokens"],
            "control_prompt_tokens": ctrl[0]["usage"]["prompt_tokens"] if ctrl else None,
        })  # fmt: skip
    return rows


def slopes(records: Sequence[dict]) -> list[dict]:
    """TTFT-vs-N slopes per (scenario, tp, mode, client): images, the text control, and their difference."""
    out = []
    timed = [r for r in records if r["scenario"] in ("cached_floor", "duplicate") and r["kind"] in _TIMED]
    controls = _group([r for r in timed if r["kind"] == "control"], "scenario", "tp", "mode")
    for (scenario, tp, mode, client), rs in sorted(_group([r for r in timed if r["kind"] == "image"], "scenario",
                                                          "tp", "mode", "client").items()):  # fmt: skip
        img = _ms_slope(rs)
        ctrl = _ms_slope(controls.get((scenario, tp, mode), []))
        if img is None:
            continue
        diff = stats.slope_difference(img, ctrl) if ctrl else None
        out.append(
            {
                "scenario": scenario,
                "tp": tp,
                "mode": mode,
                "client": client,
                "images": img.as_dict(),
                "control": ctrl.as_dict() if ctrl else None,
                "image_specific": diff.as_dict() if diff else None,
            }
        )
    return out


def turn_tables(records: Sequence[dict]) -> list[dict]:
    """Conversation and sliding window: per (scenario, tp, mode, client) the per-turn TTFT and bytes, totals, and
    how many payload deliveries each distinct image got per rank."""
    out = []
    turns = [r for r in records if r["scenario"] in ("conversation", "sliding_window")]
    for (scenario, tp, mode, client), rs in sorted(_group(turns, "scenario", "tp", "mode", "client").items()):
        rs = sorted(rs, key=lambda r: r["index"])
        distinct = len(rs)  # one new image per turn
        sent = sum(r["usage"]["images_sent"] for r in rs)
        out.append({
            "scenario": scenario, "tp": tp, "mode": mode, "client": client, "turns": len(rs),
            "ttft_ms": [r["ttft_ms"] for r in rs], "payload_bytes": [r["metrics"]["payload_bytes"] for r in rs],
            "images_sent": [r["usage"]["images_sent"] for r in rs],
            "total_payload_bytes": sum(r["metrics"]["payload_bytes"] for r in rs),
            "ttft_p50_ms": stats.median([r["ttft_ms"] for r in rs]),
            "deliveries_per_image_rank": sent / (distinct * tp),
        })  # fmt: skip
    return out


def _floor(floors: Sequence[dict], transport: str, size: str, ranks: int) -> float | None:
    hit = [f for f in floors if (f["transport"], f["size"], f["ranks"]) == (transport, size, ranks)]
    return hit[0]["p50_ms"] if hit else None


def broadcast_cost(slope_rows: Sequence[dict], floors: Sequence[dict], size: str) -> list[dict]:
    """full's per-image broadcast = full's TTFT slope minus strip's (same tp, SDK client): they differ only in the
    payloads of the cached images. Compared with the gRPC-stream and shared-memory floors for as many ranks."""
    by = {(s["scenario"], s["tp"], s["mode"], s["client"]): s for s in slope_rows}
    out = []
    for (scenario, tp, mode, client), s in by.items():
        if (scenario, mode, client) != ("cached_floor", "full", "sdk") or (scenario, tp, "strip", client) not in by:
            continue
        strip = by[(scenario, tp, "strip", client)]
        per_image = s["images"]["slope"] - strip["images"]["slope"]
        grpc, shm = _floor(floors, "grpc", size, tp), _floor(floors, "shm", size, tp)
        out.append({"tp": tp, "per_image_ms": per_image, "grpc_floor_ms": grpc, "shm_floor_ms": shm,
                    "ratio_to_grpc": per_image / grpc if grpc else None,
                    "ratio_to_shm": per_image / shm if shm else None})  # fmt: skip
    return out


def duplicate_warm(records: Sequence[dict]) -> list[dict]:
    """Duplicate control: payload deliveries of its single image per rank, over every request of the scenario."""
    out = []
    for (tp, mode), rs in sorted(_group([r for r in records if r["scenario"] == "duplicate"], "tp", "mode").items()):
        sent = sum(r["usage"]["images_sent"] for r in rs)
        out.append({"tp": tp, "mode": mode, "images_sent": sent, "deliveries_per_image_rank": sent / tp})
    return out


def analyze(records: Sequence[dict], floors: Sequence[dict], scheduler_steps: dict | None, size: str) -> dict:
    timed = [r for r in records if r["scenario"] not in ("warmup", "calibration", "tp4_correctness", "new_images")]
    analysis = {
        "cached_floor": cached_floor_tables(timed),
        "slopes": slopes(timed),
        "turns": turn_tables(timed),
        "duplicate_warm": duplicate_warm(timed),
        "equality": mode_equality(records),
        "crosscheck": byte_crosscheck(records),
        "scheduler_steps": scheduler_steps,
    }
    analysis["broadcast"] = broadcast_cost(analysis["slopes"], floors, size)
    analysis["new_images"] = new_images.analyze(records, floors)
    analysis["videos"] = videos.analyze(records)
    analysis["targets"] = targets(analysis)
    return analysis


# --- Markdown -------------------------------------------------------------------------------------------------
def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n:.0f} B"


def quick_table(analysis: dict) -> str:
    """The headline table: cached-floor TTFT and payload per request at each N, per TP and mode (SDK client)."""
    rows = [r for r in analysis["cached_floor"] if r["scenario"] == "cached_floor"]
    ns = sorted({r["n"] for r in rows})
    lines = ["| TP | mode | client | " + " | ".join(f"TTFT p50 N={n}" for n in ns)
             + " | slope ms/img [95 % CI] | image-specific | payload/req at N=" + str(ns[-1] if ns else "") + " |",
             "|" + "---|" * (6 + len(ns))]  # fmt: skip
    sl = {(s["tp"], s["mode"], s["client"]): s for s in analysis["slopes"] if s["scenario"] == "cached_floor"}
    for (tp, mode, client), rs in sorted(_group(rows, "tp", "mode", "client").items()):
        by_n = {r["n"]: r for r in rs}
        cells = [f"{by_n[n]['ttft_p50_ms']:.1f}" if n in by_n else "–" for n in ns]
        s = sl.get((tp, mode, client))
        slope = f"{s['images']['slope']:.2f} [{s['images']['ci_low']:.2f}, {s['images']['ci_high']:.2f}]" if s else "–"
        spec = f"{s['image_specific']['slope']:+.2f}" if s and s["image_specific"] else "–"
        last = _mb(by_n[ns[-1]]["payload_bytes"]) if ns[-1] in by_n else "–"
        lines.append(f"| {tp} | {mode} | {client} | " + " | ".join(cells) + f" | {slope} | {spec} | {last} |")
    ctrl = _group([r for r in rows if r["client"] == "sdk"], "tp", "mode")
    for (tp, mode), rs in sorted(ctrl.items()):
        by_n = {r["n"]: r for r in rs}
        cells = [f"{by_n[n]['control_p50_ms']:.1f}" if n in by_n and by_n[n]["control_p50_ms"] else "–" for n in ns]
        s = sl.get((tp, mode, "sdk"))
        c = s["control"] if s and s["control"] else None
        lines.append(
            f"| {tp} | {mode} | text control | "
            + " | ".join(cells)
            + (f" | {c['slope']:.2f} [{c['ci_low']:.2f}, {c['ci_high']:.2f}] | | |" if c else " | – | | |")
        )
    return "\n".join(lines)


def _header(meta: dict, analysis: dict) -> list[str]:
    """The run's machine, versions and load, and the targets table."""
    out = [f"# mmcast benchmark — {meta['plan']} ({meta['timestamp']})", "",
           f"Machine: {meta['machine']['cpu']} ({meta['machine']['cores']} cores, {meta['machine']['memory_gib']:.0f} "
           f"GiB), load average before/after {meta['machine']['loadavg_before']} / {meta['machine'].get('loadavg_after')}. "
           f"Commit {meta['git']['commit'][:12]}{' (dirty)' if meta['git']['dirty'] else ''}; torch "
           f"{meta['versions']['torch']}, transformers {meta['versions']['transformers']}, grpcio "
           f"{meta['versions']['grpcio']}. Model: the embedded tiny Qwen2-VL; images {meta['image_size']} synthetic "
           f"JPEGs; wall time {meta.get('wall_seconds', 0):.0f} s.", "",
           ]  # fmt: skip
    load = max(meta["machine"]["loadavg_before"][0], (meta["machine"].get("loadavg_after") or [0])[0])
    if load > meta["machine"]["cores"]:
        out += [
            f"**Warning:** the 1-minute load average reached {load:.1f} on {meta['machine']['cores']} cores: "
            "other processes competed for the CPUs, so times (and the floors) are inflated and noisier than on "
            "an idle machine. Byte counts and token equality are unaffected.",
            "",
        ]
    out += [
        "## Targets (issue 7, videos too; new images: issue 15)",
        "",
        "| target | goal | measured | status |",
        "|---|---|---|---|",
    ]
    out += [f"| {t['name']} | {t['target']} | {t['measured']} | {t['status']} |" for t in analysis["targets"]]
    return out


def _subject_sections(meta: dict, analysis: dict) -> list[str]:
    """New images, videos, the HTTP door and replicas: the sections of the benchmarks that ran."""
    out: list[str] = []
    fresh = new_images.markdown(analysis.get("new_images") or {"rows": []})
    if fresh:
        out += ["", "## New images: cost per never-seen image (issue 15)", "",
                "A fresh group per (TP, variant), `lazy` transfer mode, warmed; requests of N never-seen synthetic "
                "images. Payload: scheduler→ranks bytes per new image, summed over ranks (wire = the scheduler's "
                "`mmcast_broadcast_bytes_total{kind=\"payload\"}` frames; Usage = `payload_bytes_broadcast`). "
                "Encoder runs over the group and encoder-output bytes shared over the ranks' collective "
                "(`Usage.encoder_runs`, `Usage.encoder_output_bytes_shared`); collective ms: "
                "`mmcast_worker_encoder_collective_seconds` summed over ranks, the per-step status exchange and "
                "broadcasts, so it includes waiting for the slowest rank's decode and encode. "
                "Scheduler and rank CPU: the processes' CPU clocks around each request, slope against N (or the "
                "mean per image where a set has one N). The floors are one float32 `pixel_values` of that size to "
                "TP receiver processes (see below): what the `pixels` payload costs at best on each transport. "
                "`–`: not reported by this build.", "", fresh, ""]  # fmt: skip
    clips = videos.markdown(analysis.get("videos") or {}, meta.get("video", {}).get("clips", ""))
    if clips:
        out += ["", "## Videos: cached clips, a new clip, the live stream (issue 7, video inputs)", "",
                "In the transfer-mode groups (`pixels` payload, replicated encoder: what each mode saves on the "
                "heaviest payload), through the SDK (each clip uploaded once, referenced by hash); bytes are the "
                "scheduler's `mmcast_broadcast_bytes_total{kind=\"payload\"}` per request, summed over ranks; "
                "encoder runs and deliveries are `Usage.encoder_runs` and `Usage.images_sent` (videos counted as "
                "items). benchmarks/transfer/videos.py says how each figure is made.", "", clips, ""]  # fmt: skip
    if analysis.get("http_overhead"):
        out += [
            "",
            "## The HTTP door against the gRPC SDK (issue 24)",
            "",
            "One fresh group (TP1, defaults), the same requests through the SDK and the `openai` package, "
            "interleaved request by request (benchmarks/http_api/http_overhead.py).",
            "",
            http_overhead.markdown(analysis["http_overhead"]),
            "",
        ]
    scale_out = affinity.markdown(analysis.get("affinity"))
    if scale_out:
        out += ["", "## Replicas: ring hash against round robin (issue 16)", "", scale_out, ""]
    return out


def _transfer_sections(analysis: dict, floors_md: str) -> list[str]:
    """The transfer modes: the cached floor, bytes per request, conversations, the uncached path, the floors and
    the scheduler's step time."""
    out: list[str] = []
    out += [
        "",
        "## Cached floor: TTFT (client side, ms) against N cached images",
        "",
        quick_table(analysis),
        "",
        "The text control has the image prompt's token count (± 1) and is as fully cached; it pays the tokenizer on "
        "its long text every turn, which the image prompt does not, so an image-specific slope (images − control) "
        "below zero means the cached images cost less than the same number of cached text tokens.",
        "",
    ]
    out += ["## Bytes per timed request (cached floor, median)", "",
            "| scenario | TP | mode | client | N | payload | metadata | metadata/image/rank | saved | step mean ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in analysis["cached_floor"]:
        out.append(f"| {r['scenario']} | {r['tp']} | {r['mode']} | {r['client']} | {r['n']} | {_mb(r['payload_bytes'])} "
                   f"| {_mb(r['metadata_bytes'])} | {r['metadata_per_image_rank']:.0f} B | {_mb(r['saved_bytes'])} | "
                   f"{r['step_ms_mean']:.1f} |")  # fmt: skip
    if analysis["turns"]:
        out += ["", "## Conversation and sliding window", "",
                "| scenario | TP | mode | client | turns | TTFT p50 ms | TTFT last turn | payload total | deliveries/image/rank |",
                "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for t in analysis["turns"]:
            out.append(f"| {t['scenario']} | {t['tp']} | {t['mode']} | {t['client']} | {t['turns']} | "
                       f"{t['ttft_p50_ms']:.1f} | {t['ttft_ms'][-1]:.1f} | {_mb(t['total_payload_bytes'])} | "
                       f"{t['deliveries_per_image_rank']:.2f} |")  # fmt: skip
    if analysis["broadcast"]:
        out += [
            "",
            "## Uncached path: full's per-image broadcast against the floors",
            "",
            "| TP | full − strip slope ms/image | gRPC floor ms | ratio | shm floor ms | ratio |",
            "|---|---|---|---|---|---|",
        ]
        for b in analysis["broadcast"]:
            out.append(f"| {b['tp']} | {b['per_image_ms']:.2f} | {ms_text(b['grpc_floor_ms'])} | {ratio_text(b['ratio_to_grpc'])} | "
                       f"{ms_text(b['shm_floor_ms'])} | {ratio_text(b['ratio_to_shm'])} |")  # fmt: skip
    out += ["", "## Transport floors (one payload to N receiver processes, ms per image)", "", floors_md, ""]
    steps = analysis.get("scheduler_steps")
    if steps:
        out += ["## Scheduler decode-step time against items held in one session (µs)", "",
                "| mode | " + " | ".join(f"{c} items p50 / p90" for c in steps["counts"]) + " | items examined max |",
                "|" + "---|" * (2 + len(steps["counts"]))]  # fmt: skip
        for mode, v in steps["modes"].items():
            out.append(
                f"| {mode} | "
                + " | ".join(f"{r['decode_p50_us']:.1f} / {r['decode_p90_us']:.1f}" for r in v["rows"])
                + f" | {v['items_examined_max']} |"
            )
        out.append("")
    return out


def write_markdown(path: str, meta: dict, analysis: dict, floors_md: str, plots: Sequence[str]) -> None:
    from benchmarks.transfer.floors import floors_table  # noqa: F401 - the caller renders floors with it

    out = [*_header(meta, analysis), *_subject_sections(meta, analysis), *_transfer_sections(analysis, floors_md)]
    out += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots] or [
        "(plots skipped: matplotlib is not installed)"
    ]
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
