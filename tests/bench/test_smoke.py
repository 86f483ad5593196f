"""The benchmark driver on its smallest plan, end to end, so it cannot rot: real groups, floors, scenarios (new
images and videos included), the mode-equality check and every output file."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("transformers")
pytest.importorskip("prometheus_client")

pytestmark = pytest.mark.slow


def test_smoke_plan_writes_results_and_checks_mode_equality(tmp_path, tiny_model_dir):
    from benchmarks import run

    out = tmp_path / "smoke"
    code = run.main(["--smoke", "--out", str(out), "--model-dir", str(tiny_model_dir)])
    assert code == 0, (out / "results.md").read_text() if (out / "results.md").exists() else "no results.md"

    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["plan"] == "smoke"
    assert data["meta"]["git"]["commit"]
    assert {"torch", "transformers", "grpcio"} <= set(data["meta"]["versions"])
    assert {f["transport"] for f in data["floors"]} == {"grpc", "tcp", "shm"}
    assert all(len(f["samples_ms"]) >= 10 for f in data["floors"])

    analysis = data["analysis"]
    equality = analysis["equality"]
    assert equality["ok"] and equality["checked"] > 0 and not equality["mismatches"]
    assert {r["mode"] for r in data["records"]} == {"full", "lazy"}  # new images run in lazy
    assert analysis["crosscheck"]["requests"] == len(data["records"])
    assert any(s["scenario"] == "cached_floor" and s["image_specific"] for s in analysis["slopes"])
    assert analysis["scheduler_steps"]["counts"] == [10, 100]

    # Cached images cost no payload in lazy; full resends them every request.
    rows = {(r["mode"], r["n"]): r for r in analysis["cached_floor"] if r["client"] == "sdk"}
    assert rows[("lazy", 2)]["payload_bytes"] == 0
    assert rows[("full", 2)]["payload_bytes"] > 0

    # New images, the default variant (encoded payload, sharded encoder) at TP1: the client's file travels once
    # (+ frame headers), one encoder run per image, and the scheduler's CPU was measured.
    (row,) = analysis["new_images"]["rows"]
    assert (row["tp"], row["variant"], row["image"], row["images"]) == (1, "encoded+sharded", "448x448 jpeg", 6)
    assert row["file_bytes"] <= row["payload_bytes_wire"] <= row["file_bytes"] + 1024
    assert row["payload_bytes_usage"] == row["file_bytes"]
    assert row["encoder_runs"] == row["encoder_runs_ranks"] == 1.0
    assert row["scheduler_cpu_ms"] is not None and row["floor_grpc_ms"] is not None
    assert {r["variant"] for r in data["records"] if r["scenario"] == "new_images"} == {"encoded+sharded"}

    # Videos, one tiny lazy pass at TP1: cached clips cost no payload, the live stream sends each segment once.
    v = analysis["videos"]
    assert [(r["tp"], r["mode"], r["ns"]) for r in v["cached"]] == [(1, "lazy", [1, 2])]
    assert set(v["cached"][0]["payload_bytes_by_n"].values()) == {0}
    assert v["stream"][0]["deliveries_per_segment_rank"] == 1.0 and v["new"][0]["payload_bytes"] > 0
    assert data["meta"]["video"]["seconds_in_groups"] > 0

    # Structured output beside free decoding: one small pass; greedy text unchanged by the constrained neighbour.
    grammar = analysis["grammar_cost"]
    assert grammar["same_text"] and grammar["rounds"] == 2
    assert all(v > 0 for v in grammar["step_ms"].values()) and grammar["ratio"] > 0
    assert "beside_constrained / alone" in (out / "grammar_cost.md").read_text()

    md = (out / "results.md").read_text()
    assert "## Targets (issue 7" in md and "all modes return the same tokens" in md
    assert "## New images: cost per never-seen image" in md and "## Videos: cached clips" in md
    for name in ("results.json", "results.md"):
        assert os.path.getsize(out / name) > 0
