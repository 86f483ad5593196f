"""benchmarks/peer/compare.py without vLLM (which lives in .venv-peer, not here): the report's arithmetic on made-up
figures, and the smoke plan end to end against one mmcast group, so the side-by-side driver cannot rot."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("openai")


def _point(rate, p99, throughput, wait=0.0, offered=10, failed=0):
    return {
        "rate": rate,
        "offered": offered,
        "completed": offered - failed,
        "failed": failed,
        "ttft_p99_ms": p99,
        "request_throughput": throughput,
        "output_token_throughput": 16 * throughput,
        "conversation_wait_p99_ms": wait,
    }


def test_throughput_at_the_slo_compares_the_rate_held_then_ties_within_one_percent():
    from benchmarks.peer.peer_report import throughput_held

    assert throughput_held({"rate": 2.0, "request_throughput": 1.5}, {"rate": 1.0, "request_throughput": 0.8})
    assert not throughput_held({"rate": 1.0, "request_throughput": 0.8}, {"rate": 2.0, "request_throughput": 1.5})
    # The same schedule served whole by both: the achieved rates differ by when the last answer landed.
    assert throughput_held({"rate": 1.0, "request_throughput": 0.8097}, {"rate": 1.0, "request_throughput": 0.8101})
    assert not throughput_held({"rate": 1.0, "request_throughput": 0.78}, {"rate": 1.0, "request_throughput": 0.81})
    assert not throughput_held({"rate": None, "request_throughput": 0.0}, {"rate": 0.5, "request_throughput": 0.5})
    assert throughput_held({"rate": 0.5, "request_throughput": 0.5}, {"rate": None, "request_throughput": 0.0})


def test_a_rate_is_held_within_the_slo_without_holding_conversations_back():
    from benchmarks.peer.peer_report import at_slo, holds

    assert holds(_point(1.0, 900, 0.95), 1000)
    assert not holds(_point(1.0, 1100, 0.95), 1000)  # p99 over the SLO
    assert not holds(_point(1.0, 900, 0.5, wait=4000), 1000)  # fell behind: questions waited for late answers
    assert not holds(_point(1.0, 900, 0.95, failed=1), 1000)
    best = at_slo([_point(0.5, 300, 0.5), _point(1.0, 900, 0.97), _point(2.0, 3000, 1.1)], 1000)
    assert best["rate"] == 1.0 and best["request_throughput"] == 0.97
    assert at_slo([_point(2.0, 3000, 1.1)], 1000) == {"rate": None, "request_throughput": 0.0}


def test_question_permutations_are_distinct_and_of_equal_length():
    from benchmarks.peer.peer_client import question

    qs = [question(i) for i in range(20)]
    assert len(set(qs)) == 20
    assert len({len(q.split()) for q in qs}) == 1


@pytest.mark.slow
def test_smoke_plan_on_mmcast_alone_writes_every_workload(tmp_path):
    from benchmarks.peer import compare as peer

    out = tmp_path / "peer"
    assert peer.main(["--smoke", "--engines", "mmcast_tp1", "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    res = data["engines"]["mmcast_tp1"]
    assert {"cached", "new", "load", "ladder", "max", "burst", "sliding", "video", "texts"} <= set(res)
    # the cached workload's prompts hit the prefix cache: every image token cached
    rows = [r for r in res["cached"]["rows"] if r["n"] == 2]
    assert rows and all(r["cached_tokens"] >= 2 * 256 for r in rows)
    assert res["load"][0]["completed"] == res["load"][0]["offered"] == 4
    # the ladder went on from 2/s only if 2/s was held, and carries each rate's CPU seconds
    assert res["ladder"]["stopped"] in ("failed", "cap", "budget")
    assert len(res["load"]) == 2 or res["ladder"]["stopped"] != "cap"
    assert all(p["engine_cpu_s"] > 0 for p in res["load"])
    for variant in ("new", "cached"):  # closed loop: every request at once, each answered in full
        m = res["max"][variant]
        assert m["completed"] == 3 and m["failed"] == 0 and m["request_throughput"] > 0
        assert all(r["completion_tokens"] == 4 for r in m["rows"])
    assert all(r["cached_tokens"] >= 256 for r in res["max"]["cached"]["rows"])  # the warmed image
    b = res["burst"]
    assert b["completed"] == 3 and b["failed"] == 0 and b["ttft_spread_ms"] >= 0 and b["decode_itl_p99_ms"] > 0
    assert data["analysis"]["stages"]["mmcast_tp1"]["cached"]["requests"] == 1  # N=2 once, probed
    # video: the cached clips hit the prefix cache; the stream's window slid once (4 turns, 3 kept)
    v = res["video"]
    assert "error" not in v, v
    assert all(r["cached_tokens"] >= 100 * r["n"] for r in v["cached"]["rows"])
    assert [r["segments"] for r in v["stream"]["rows"]] == [1, 2, 3, 3]
    assert v["new"]["ttft_p50_ms"] > 0 and v["stream"]["ttft_p50_after_window_ms"] > 0
    assert data["analysis"]["video_notes"] == ["vLLM did not run (--engines): no video ratio"]
    md = (out / "results.md").read_text()
    assert "Video (320x180" in md
    assert "TTFT breakdown (mmcast) beside vLLM's TTFT" in md and "Closed loop" in md
    assert all(r["completion_tokens"] == 4 for r in res["new"]["448x448"]["rows"])  # ignore_eos: fixed length
    assert md.count("| mmcast_tp1 |") >= 4
