"""The HTTP-overhead benchmark (benchmarks/http_api/http_overhead.py): its analysis on synthetic records, and its smallest plan
end to end against a real group (the doors agree, every cell is timed, the tables render). No timing is asserted:
the machine is shared."""

from __future__ import annotations

import pytest

from benchmarks.http_api import http_overhead as ho
from benchmarks.http_api import http_overhead_analysis as hoa


def _rec(scenario, door, index, ttft, text="abc", n=0, image=""):
    return {
        "scenario": scenario,
        "door": door,
        "index": index,
        "ttft_ms": ttft,
        "total_ms": ttft + 5,
        "text": text,
        "completion_tokens": 4,
        "prompt_tokens": 10,
        "cached_tokens": 0,
        "scheduler_cpu_ms": 1.0,
        "n": n,
        "image": image,
    }


def test_analysis_pairs_rounds_and_judges_the_target_like_for_like():
    recs = []
    for r in range(1, 6):
        recs += [_rec("text", hoa.GRPC_UPLOAD, r, 10.0), _rec("text", hoa.HTTP_DATA, r, 11.0)]  # 1.10x: met
        for door, t in ((hoa.GRPC_UPLOAD, 10.0), (hoa.GRPC_INLINE, 20.0), (hoa.HTTP_DATA, 30.0)):  # 1.5x inline: missed
            recs.append(_rec("new_image", door, r, t, n=1, image="448x448 jpeg"))
    recs += [_rec("new_image", d, -1, 50.0, n=1, image="448x448 jpeg") for d in hoa.SCENARIO_DOORS["new_image"]]
    out = hoa.analyze(recs, [])
    by = {(t["name"].split(": ")[-1]): t["status"] for t in out["targets"]}
    assert by == {"text only": "met", "one new 448x448 jpeg": "MISSED"}
    ratio = next(r for r in out["ratios"] if r["scenario"] == "text")
    assert ratio["ratio"] == pytest.approx(1.1) and ratio["pairs"] == 5
    assert out["equality"]["ok"] and out["equality"]["checked"] == 6  # 5 text rounds + 1 image equality request


def test_a_different_answer_on_one_door_fails_equality():
    recs = [_rec("text", hoa.GRPC_UPLOAD, 1, 10.0), _rec("text", hoa.HTTP_DATA, 1, 10.0, text="abd")]
    eq = hoa.analyze(recs, [])["equality"]
    assert not eq["ok"] and eq["mismatches"][0]["key"][0] == "text"


@pytest.mark.slow
def test_smallest_plan_runs_against_a_real_group(tmp_path, tiny_model_dir):
    pytest.importorskip("openai")
    from benchmarks.support.scenarios import Images

    plan = ho.PLANS["test"]
    result = ho.measure(str(tiny_model_dir), Images(str(tmp_path / "images"), (448, 448)), plan)
    assert result["equality"]["ok"], result["equality"]["mismatches"]
    assert len(result["records"]) == ho.planned_requests(plan)
    cells = {(r["scenario"], r["n"]): set(r["doors"]) for r in result["rows"]}
    assert cells == {
        ("text", 0): set(hoa.SCENARIO_DOORS["text"]),
        ("new_image", 1): set(hoa.SCENARIO_DOORS["new_image"]),
        ("cached_conversation", 2): set(hoa.DOORS),
    }
    conv = next(r for r in result["rows"] if r["scenario"] == "cached_conversation")
    # The earlier image is in the prefix cache whichever way it is named: by hash, by uuid, or its bytes again.
    cached = {d: v["cached_tokens"] for d, v in conv["doors"].items()}
    assert len(set(cached.values())) == 1 and min(cached.values()) > 256, cached
    assert {t["status"] for t in result["targets"]} <= {"met", "MISSED"}
    md = ho.write(str(tmp_path / "out"), result)
    assert "HTTP ÷ gRPC" in md and "b64decode" in md and (tmp_path / "out" / "http_overhead.json").exists()
