"""The benchmark analysis on synthetic records: slopes, targets, equality and byte cross-checks, Markdown."""

from __future__ import annotations

import random

import pytest

from benchmarks import report

PAYLOAD = 22_500_000


def _rec(
    scenario,
    kind,
    mode,
    n,
    index,
    ttft,
    *,
    tp=1,
    client="sdk",
    payload=0,
    metadata=None,
    tokens=(1, 2),
    sent=0,
    worker_payload=None,
):
    metadata = 80 * n * tp if metadata is None else metadata
    return {
        "scenario": scenario, "kind": kind, "client": client, "tp": tp, "mode": mode, "n": n, "index": index,
        "ttft_ms": ttft, "server_ttft_ms": ttft, "total_ms": ttft, "token_ids": list(tokens),
        "usage": {"prompt_tokens": 100 * n + 20, "images_sent": sent},
        "metrics": {"payload_bytes": payload, "metadata_bytes": metadata, "control_bytes": 300,
                    "saved_prefix_bytes": 0, "saved_rank_bytes": 0, "step_seconds_sum": 0.01, "steps": 2,
                    "schedule_seconds_sum": 0.0, "worker_payload_bytes": payload if worker_payload is None
                    else worker_payload, "worker_metadata_bytes": metadata, "worker_control_bytes": 300},
    }  # fmt: skip


def _records(full_slope=20.0, lazy_slope=1.0, control_slope=1.0, seed=0):
    rng = random.Random(seed)
    out = []
    for mode, slope in (("full", full_slope), ("strip", lazy_slope), ("lazy", lazy_slope)):
        for n in (2, 13, 26):
            for i in range(1, 6):
                payload = PAYLOAD * n if mode == "full" else 0
                out.append(
                    _rec("cached_floor", "image", mode, n, i, 30 + slope * n + rng.gauss(0, 0.3), payload=payload)
                )
                out.append(_rec("cached_floor", "control", mode, n, i, 30 + control_slope * n + rng.gauss(0, 0.3)))
        for t in range(4):
            out.append(
                _rec(
                    "sliding_window", "image", mode, min(t + 1, 2), t, 50.0, sent=1 if mode == "lazy" else min(t + 1, 2)
                )
            )
    return out


def test_slopes_targets_and_broadcast_cost():
    floors = [
        {"transport": "grpc", "size": "1280x720", "ranks": 1, "p50_ms": 15.0},
        {"transport": "shm", "size": "1280x720", "ranks": 1, "p50_ms": 3.0},
    ]
    a = report.analyze(_records(), floors, None, "1280x720")
    by = {(s["mode"], s["client"]): s for s in a["slopes"]}
    assert by[("full", "sdk")]["images"]["slope"] == pytest.approx(20.0, abs=0.1)
    assert by[("lazy", "sdk")]["image_specific"]["slope"] == pytest.approx(0.0, abs=0.05)
    (b,) = a["broadcast"]
    assert b["per_image_ms"] == pytest.approx(19.0, abs=0.2)
    assert b["ratio_to_grpc"] == pytest.approx(19.0 / 15.0, rel=0.02)
    status = {t["name"]: t["status"] for t in a["targets"]}
    assert status["strip/lazy: payload bytes of fully cached images"] == "met"
    assert status["strip/lazy: metadata per cached image per rank"] == "met"
    assert status["all modes return the same tokens"] == "met"
    assert status["scheduler byte counters = workers' received bytes"] == "met"
    assert status["full per-image broadcast, TP1 (full − strip slope)"] == "met"
    lazy_window = [t for t in a["turns"] if t["mode"] == "lazy"][0]
    assert lazy_window["deliveries_per_image_rank"] == 1.0


def test_misses_are_reported_not_hidden():
    recs = _records(lazy_slope=3.0)
    recs[0]["token_ids"] = [9, 9]  # one full-mode answer differs
    recs[1]["metrics"]["worker_payload_bytes"] += 1
    a = report.analyze(recs, [], None, "1280x720")
    status = {t["name"]: t["status"] for t in a["targets"]}
    assert status["all modes return the same tokens"] == "MISSED"
    assert status["scheduler byte counters = workers' received bytes"] == "MISSED"
    assert status["lazy image-specific TTFT slope (images − text control), sdk client"] == "MISSED"
    assert a["equality"]["mismatches"][0]["tokens"]["full"] == [9, 9]


def test_markdown_lists_every_target(tmp_path):
    a = report.analyze(_records(), [], None, "1280x720")
    meta = {"plan": "unit", "timestamp": "now", "image_size": "1280x720", "wall_seconds": 1.0,
            "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 24.0, "loadavg_before": [0, 0, 0]},
            "git": {"commit": "0" * 40, "dirty": False},
            "versions": {"torch": "x", "transformers": "y", "grpcio": "z"}}  # fmt: skip
    path = tmp_path / "results.md"
    report.write_markdown(str(path), meta, a, "| floors |", [])
    text = path.read_text()
    for t in a["targets"]:
        assert t["name"] in text
    assert "TTFT p50 N=26" in text


def test_plots_render_when_matplotlib_is_installed(tmp_path):
    from benchmarks import plots

    if not plots.available():
        pytest.skip("matplotlib is not installed (the plots are optional)")
    a = report.analyze(_records(), [], None, "1280x720")
    written = plots.write_plots(str(tmp_path), a)
    assert {p.rsplit("/", 1)[1] for p in written} == {"ttft_vs_n.png", "bytes_per_request.png", "ttft_per_turn.png"}
