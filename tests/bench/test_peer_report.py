"""The side-by-side report's arithmetic on made-up inputs (benchmarks/peer/peer_analysis.py, peer_capacity.py,
peer_stages.py, peer_tables.py): the SLO ladder's stop rule, ratios per TP size, medians and spreads over rounds,
the goals' verdicts, and the stage histogram's parsing. No engine runs here."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")

SLO = 1000.0


def _point(rate, p99, throughput, wait=0.0, offered=10, failed=0, cpu=None):
    p = {"rate": rate, "offered": offered, "completed": offered - failed, "failed": failed, "ttft_p50_ms": p99 / 2,
         "ttft_p99_ms": p99, "tpot_p50_ms": 8.0, "request_throughput": throughput,
         "output_token_throughput": 16 * throughput, "conversation_wait_p99_ms": wait}  # fmt: skip
    if cpu is not None:
        p["engine_cpu_s"] = cpu
    return p


def _run(scale: float = 1.0, throughput: float = 1.0, held=(1.0, 2.0), failed_at=3.0, tpot=8.0, cpu=1.0):
    """One engine's round: every latency ``scale`` times a reference, throughput ``throughput`` times it."""
    load = [_point(r, 500, r * 0.9, cpu=cpu * 10) for r in held]
    if failed_at is not None:
        load.append(_point(failed_at, 2500, failed_at * 0.5, cpu=cpu * 10))
    load[0]["tpot_p50_ms"] = tpot
    closed = {k: {"request_throughput": throughput * v, "output_token_throughput": 32 * throughput * v,
                  "ttft_p50_ms": 300 * scale, "ttft_p99_ms": 900 * scale, "ttft_spread_ms": 600 * scale,
                  "tpot_p50_ms": 20 * scale, "itl_p99_ms": 80 * scale} for k, v in (("new", 4.0), ("cached", 12.0))}  # fmt: skip
    return {
        "cached": {"ttft_p50_by_n": {2: 100 * scale, 8: 110 * scale}, "slope": {"slope": 2.0 * scale}},
        "new": {"448x448": {"ttft_p50_by_n": {1: 200 * scale, 4: 650 * scale}, "slope": {"slope": 150 * scale}}},
        "sliding": {"ttft_mean_after_window_ms": 300 * scale},
        "load": load,
        "max": closed,
        "burst": {
            "decode_itl_p99_in_burst_ms": 50 * scale,
            "decode_itl_p99_ms": 30 * scale,
            "decode_stall_p50_ms": 200 * scale,
            "decode_stall_max_ms": 400 * scale,
            "ttft_p50_ms": 900 * scale,
            "ttft_p99_ms": 1500 * scale,
            "ttft_spread_ms": 1200 * scale,
        },
    }


# --- the SLO ladder ------------------------------------------------------------------------------------------


def test_the_ladder_stops_at_the_first_rate_failed_at_the_cap_or_when_its_time_is_spent():
    from benchmarks.peer.peer_capacity import first_failing_rate, ladder_stops

    rates = (1.0, 2.0, 4.0)
    assert ladder_stops([], SLO, rates, 0.0, 100.0) is None  # nothing offered yet
    assert ladder_stops([_point(1.0, 400, 0.9)], SLO, rates, 10.0, 100.0) is None
    assert ladder_stops([_point(1.0, 400, 0.9), _point(2.0, 1500, 1.2)], SLO, rates, 10.0, 100.0) == "failed"
    # a rate whose conversations fell behind fails even with every TTFT within the SLO
    assert ladder_stops([_point(1.0, 400, 0.9, wait=3000)], SLO, rates, 10.0, 100.0) == "failed"
    assert ladder_stops([_point(1.0, 400, 0.9, failed=1)], SLO, rates, 10.0, 100.0) == "failed"
    assert ladder_stops([_point(r, 400, r) for r in rates], SLO, rates, 10.0, 100.0) == "cap"
    assert ladder_stops([_point(1.0, 400, 0.9)], SLO, rates, 100.0, 100.0) == "budget"
    assert first_failing_rate([_point(1.0, 400, 0.9), _point(2.0, 1500, 1.2)], SLO) == 2.0
    assert first_failing_rate([_point(1.0, 400, 0.9), _point(2.0, 400, 1.9)], SLO) is None


def test_the_ladder_offers_rates_in_turn_until_one_fails(monkeypatch):
    import asyncio

    from benchmarks.peer import peer_capacity
    from benchmarks.peer.peer_workloads import LoadPlan

    p99_by_rate = {1.0: 300, 2.0: 700, 3.0: 1800, 4.0: 300}  # 4/s would "hold": it must never be offered

    async def fake_load(client, parts, plan, i, texts):
        rate = plan.all_rates[i]
        return _point(rate, p99_by_rate[rate], rate)

    offered = []

    async def step(name, coro):
        offered.append(name)
        return await coro

    monkeypatch.setattr(peer_capacity, "load", fake_load)
    plan = LoadPlan(rates=(1.0, 2.0, 3.0, 4.0), conversations=2, turns=2, max_tokens=4)
    got = asyncio.run(peer_capacity.ladder(None, None, plan, SLO, {}, step))
    assert offered == ["load 1/s", "load 2/s", "load 3/s"]
    assert got["stopped"] == "failed" and got["first_failing_rate"] == 3.0
    assert [p["rate"] for p in got["points"]] == [1.0, 2.0, 3.0]

    # the first rate failed: the rates below it, highest first, down to one held (then no lower one)
    p99_by_rate.update({1.0: 1500, 0.5: 1200, 0.25: 400, 0.1: 100})
    offered.clear()
    plan = LoadPlan(rates=(1.0, 2.0), conversations=2, turns=2, max_tokens=4, below=(0.5, 0.25, 0.1))
    got = asyncio.run(peer_capacity.ladder(None, None, plan, SLO, {}, step))
    assert offered == ["load 1/s", "load 0.5/s", "load 0.25/s"]
    assert got["first_failing_rate"] == 0.5
    from benchmarks.peer.peer_analysis import run_figures

    f = run_figures({"load": got["points"]}, SLO)
    assert f["rate_at_slo"] == 0.25 and f["first_failing_rate"] == 0.5
    assert f["tpot_p50_ms"] == got["points"][0]["tpot_p50_ms"]  # TPOT at the ladder's first rate, not below it


def test_higher_rates_get_more_conversations_so_each_offers_the_minimum_schedule():
    from benchmarks.peer.peer_workloads import LoadPlan

    plan = LoadPlan(rates=(1.0, 8.0), conversations=8, turns=3, max_tokens=16, min_schedule_s=12)
    assert plan.conversations_at(1.0) == 8  # 24 requests: 24 s of arrivals already
    assert plan.conversations_at(8.0) == 32  # 96 requests: 12 s at 8/s
    assert LoadPlan((8.0,), 8, 3, 16).conversations_at(8.0) == 8  # no minimum: the plan's count


# --- closed loop and burst summaries -------------------------------------------------------------------------


def test_closed_loop_summary_spans_the_first_send_to_the_last_token():
    from benchmarks.peer.peer_capacity import gaps_in_window, summarise

    rows = [{"ttft_ms": t, "tpot_ms": 10.0, "itl_ms": [10.0, 12.0], "completion_tokens": 4, "end_s": e}
            for t, e in ((100.0, 1.0), (300.0, 2.0), (500.0, 4.0))]  # fmt: skip
    s = summarise(rows, failed=1)
    assert s["request_throughput"] == pytest.approx(3 / 4.0)
    assert s["output_token_throughput"] == pytest.approx(12 / 4.0)
    assert s["ttft_spread_ms"] == 400.0 and s["ttft_p50_ms"] == 300.0 and s["failed"] == 1
    assert summarise([], 2) == {"completed": 0, "failed": 2}
    # gaps whose later chunk lands in (lo, hi]: the decode's gaps while the burst is being admitted
    assert gaps_in_window([0.0, 0.1, 0.5, 0.6, 1.5], 0.05, 1.0) == pytest.approx([100.0, 400.0, 100.0])


def test_a_decodes_longest_stall_counts_a_gap_spanning_the_window_whole():
    from benchmarks.peer.peer_capacity import gaps_in_window, longest_stall

    # delivered in a bunch: nothing during the window [1.0, 2.0], then five chunks at once
    bunched = [0.0, 0.5, 2.5, 2.5001, 2.5002, 2.5003, 2.5004]
    assert gaps_in_window(bunched, 1.0, 2.0) == []  # no gap ends in the window: the gap figures see nothing
    assert longest_stall(bunched, 1.0, 2.0) == pytest.approx(2000.0)  # the decode waited 2 s
    streamed = [0.0, 0.9, 1.1, 1.4, 1.5, 2.1]
    assert longest_stall(streamed, 1.0, 2.0) == pytest.approx(600.0)  # 1.5 -> 2.1 overlaps the window's end
    assert longest_stall([0.0, 0.1, 0.2], 1.0, 2.0) is None  # ended before the burst


# --- medians, spreads, ratios, goals -------------------------------------------------------------------------


def test_medians_and_spreads_skip_rounds_without_the_figure():
    from benchmarks.peer.peer_analysis import aggregate, combine

    assert aggregate([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert aggregate([None, 4.0]) == {"median": 4.0, "min": 4.0, "max": 4.0, "n": 1}
    assert aggregate([None, None])["median"] is None
    med, spread = combine([{"a": 1.0, "b": None}, {"a": 5.0, "b": 2.0}, {"a": 3.0}])
    assert med == {"a": 3.0, "b": 2.0} and spread == {"a": [1.0, 5.0], "b": [2.0, 2.0]}


def test_ratios_per_tp_size_from_every_figure_of_the_issue():
    from benchmarks.peer.peer_analysis import analyze_rounds

    rounds = {"vllm": [_run()], "mmcast_tp1": [_run(0.8, 1.25, tpot=10.0, cpu=0.4)], "mmcast_tp2": [_run(0.5)]}
    a = analyze_rounds(rounds, SLO)
    r = a["ratios"]
    for key in ("cached_n2_ttft_ratio", "new_n1_ttft_ratio", "sliding_ttft_ratio", "cached_ttft_slope_ratio",
                "new_image_ttft_ratio", "burst_itl_p99_ratio", "burst_stall_p50_ratio", "burst_stall_max_ratio"):  # fmt: skip
        assert r[key] == pytest.approx(0.8), key
        assert r[key + "_tp2"] == pytest.approx(0.5), key
    assert r["tpot_ratio"] == pytest.approx(10.0 / 8.0)
    # a reference slope ≤ 0 (noise) gives no ratio rather than a negative one read as "met"
    noisy = _run()
    noisy["cached"]["slope"] = {"slope": -3.0}
    assert analyze_rounds({"vllm": [noisy], "mmcast_tp1": [_run()]}, SLO)["ratios"]["cached_ttft_slope_ratio"] is None
    assert r["max_throughput_ratio_new"] == pytest.approx(1.25)
    assert r["max_throughput_ratio_cached"] == pytest.approx(1.25)
    assert r["throughput_at_slo_ratio"] == pytest.approx(1.0)  # both held 2/s, first failed 3/s
    assert r["cpu_s_per_request_ratio"] == pytest.approx(0.4)
    assert r["cpu_s_per_request_ratio_at_2"] == pytest.approx(0.4) and "cpu_s_per_request_ratio_at_2_tp2" in r
    f = a["figures"]["mmcast_tp1"]
    assert f["first_failing_rate"] == 3.0 and f["rate_at_slo"] == 2.0 and f["highest_rate_offered"] == 3.0


def test_cpu_ratio_only_over_the_rates_both_engines_were_offered():
    from benchmarks.peer.peer_analysis import analyze_rounds

    # vLLM failed at 2/s, mmcast went on to 4/s: only 1 and 2/s are compared
    vllm = _run(held=(1.0,), failed_at=2.0, cpu=1.0)
    mmcast = _run(held=(1.0, 2.0), failed_at=4.0, cpu=0.3)
    r = analyze_rounds({"vllm": [vllm], "mmcast_tp1": [mmcast]}, SLO)["ratios"]
    assert r["cpu_s_per_request_ratio"] == pytest.approx(0.3)
    assert {k for k in r if k.startswith("cpu_s_per_request_ratio_at_")} == {
        "cpu_s_per_request_ratio_at_1",
        "cpu_s_per_request_ratio_at_2",
    }


def test_rounds_give_median_ratios_with_their_spread_and_goals_judge_the_median():
    from benchmarks.peer import peer_tables
    from benchmarks.peer.peer_analysis import analyze_rounds

    rounds = {"vllm": [_run(), _run(), _run()], "mmcast_tp1": [_run(0.7), _run(1.2), _run(0.8)]}
    a = analyze_rounds(rounds, SLO)
    assert a["rounds"] == 3
    assert a["ratios"]["cached_n2_ttft_ratio"] == pytest.approx(0.8)
    assert a["ratio_spread"]["cached_n2_ttft_ratio"] == pytest.approx([0.7, 1.2])
    assert a["figures"]["mmcast_tp1"]["cached_n2_ttft_p50_ms"] == pytest.approx(80.0)
    assert a["spread"]["mmcast_tp1"]["cached_n2_ttft_p50_ms"] == pytest.approx([70.0, 120.0])
    goals = {g["name"]: g for g in a["goals"]}
    g = goals["TP1 cached N=2 TTFT p50 ≤ 1.0× vLLM's"]
    assert g["status"] == "met" and "0.80 [0.70–1.20]" in g["measured"]
    assert goals["TP1 cached-image TTFT slope ≤ 0.5× vLLM's"]["status"] == "missed"  # 0.8 > 0.5
    assert "0.80 [0.70–1.20]" in peer_tables.ratios(a)
    assert "80.000 [70.000–120.000]" in peer_tables.figures(a)


def test_throughput_goals_meet_at_one_beyond_at_one_point_two_and_name_the_first_failing_rates():
    from benchmarks.peer.peer_analysis import analyze_rounds

    def goals(mmcast, vllm):
        return {g["name"]: g for g in analyze_rounds({"vllm": [vllm], "mmcast_tp1": [mmcast]}, SLO)["goals"]}

    name = "TP1 closed-loop max throughput, new images ≥ 1.0× vLLM's (beyond: 1.2×)"
    assert goals(_run(throughput=1.1), _run())[name]["status"] == "met"
    assert goals(_run(throughput=1.3), _run())[name]["status"] == "met (beyond)"
    assert goals(_run(throughput=0.9), _run())[name]["status"] == "missed"
    at_slo = "TP1 request throughput at the SLO ≥ 1.0× vLLM's"
    g = goals(_run(held=(1.0, 2.0, 3.0), failed_at=4.0), _run(held=(1.0,), failed_at=2.0))[at_slo]
    assert g["status"] == "met"
    assert "first failed 4/s" in g["measured"] and "first failed 2/s" in g["measured"]
    g = goals(_run(held=(1.0,), failed_at=2.0), _run(held=(1.0, 2.0), failed_at=None))[at_slo]
    assert g["status"] == "missed" and "none failed up to 2/s" in g["measured"]
    cpu = "TP1 engine CPU s per request at the offered rates ≤ 0.5× vLLM's"
    assert goals(_run(cpu=0.4), _run())[cpu]["status"] == "met"
    assert goals(_run(cpu=0.6), _run())[cpu]["status"] == "missed"
    assert goals(_run(), _run())["TP1 TPOT p50 (load, first rate) ≤ 1.0× vLLM's"]["status"] == "met"
    assert goals(_run(tpot=9.0), _run())["TP1 TPOT p50 (load, first rate) ≤ 1.0× vLLM's"]["status"] == "missed"


def test_without_vllm_every_goal_is_not_applicable():
    from benchmarks.peer.peer_analysis import analyze_rounds

    a = analyze_rounds({"mmcast_tp1": [_run()]}, SLO)
    assert a["ratios"] == {}
    assert {g["status"] for g in a["goals"]} == {"n/a"}


# --- the stage histogram -------------------------------------------------------------------------------------

EXPOSITION = """\
# HELP mmcast_request_stage_seconds Time per request stage.
# TYPE mmcast_request_stage_seconds histogram
mmcast_request_stage_seconds_bucket{stage="queue",le="0.01"} 3.0
mmcast_request_stage_seconds_bucket{stage="queue",le="+Inf"} 4.0
mmcast_request_stage_seconds_sum{stage="queue"} 0.02
mmcast_request_stage_seconds_count{stage="queue"} 4.0
mmcast_request_stage_seconds_bucket{stage="encode",le="+Inf"} 2.0
mmcast_request_stage_seconds_sum{stage="encode"} 0.3
mmcast_request_stage_seconds_count{stage="encode"} 2.0
mmcast_request_stage_seconds_sum{stage="brand_new"} 0.5
mmcast_request_stage_seconds_count{stage="brand_new"} 1.0
# TYPE mmcast_scheduler_requests_total counter
mmcast_scheduler_requests_total 7.0
"""


def test_stage_histogram_parses_with_any_stage_label_and_reads_absent_as_none():
    from benchmarks.peer.peer_stages import parse

    got = parse(EXPOSITION)
    assert got == {"queue": (0.02, 4.0), "encode": (0.3, 2.0), "brand_new": (0.5, 1.0)}
    untyped = "\n".join(line for line in EXPOSITION.splitlines() if not line.startswith("#")) + "\n"
    assert parse(untyped) == got  # no TYPE lines: every sample its own family
    # other labels beside the stage are summed over
    two = 'mmcast_request_stage_seconds_sum{stage="queue",tp="1"} 1.0\nmmcast_request_stage_seconds_sum{stage="queue",tp="2"} 2.0\n'
    assert parse(two) == {"queue": (3.0, 0.0)}
    assert parse("# TYPE mmcast_scheduler_requests_total counter\nmmcast_scheduler_requests_total 7.0\n") is None


def test_stage_deltas_give_means_per_observation_in_pipeline_order_and_the_table_says_when_absent():
    from benchmarks.peer import peer_stages

    acc = peer_stages.new_accumulator()
    before = {"queue": (0.01, 2.0)}
    after = {"queue": (0.03, 4.0), "rank": (0.4, 2.0), "rank_encode": (0.3, 2.0), "brand_new": (0.5, 1.0)}
    peer_stages.add(acc, before, after)
    later = {"queue": (0.05, 6.0), "rank": (0.6, 3.0), "rank_encode": (0.5, 3.0), "brand_new": (0.5, 1.0)}
    peer_stages.add(acc, after, later)
    m = peer_stages.means(acc)
    assert list(m) == ["queue", "rank", "rank_encode", "brand_new"]  # pipeline order, the rank's parts, others
    assert m["queue"]["mean_ms"] == pytest.approx(10.0) and m["queue"]["per_request"] == pytest.approx(2.0)
    assert m["rank_encode"]["mean_ms"] == pytest.approx(500.0 / 3)  # (0.3 + 0.2) s over 2 + 1 observations
    merged = peer_stages.merge([acc, None, acc])
    assert merged["requests"] == 4 and merged["stages"]["rank_encode"][1] == pytest.approx(6.0)
    table = peer_stages.markdown([("mmcast_tp1 cached N=2", m, 90.0)], [120.0])
    assert "| queue | 10.00 (2) |" in table and "| vLLM client TTFT p50 (sliding: mean) | 120.0 |" in table
    # the sum is of the stages that follow one another: queue and rank, not rank_encode (inside rank) nor others
    want = m["queue"]["ms_per_request"] + m["rank"]["ms_per_request"]
    assert f"per request | {want:.1f} |" in table
    absent = peer_stages.new_accumulator()
    peer_stages.add(absent, None, None)  # a build without the metric
    assert peer_stages.means(absent) is None
    assert peer_stages.NOT_EXPORTED in peer_stages.markdown([("mmcast_tp1 new N=1", None, 200.0)], [150.0])


# --- video ---------------------------------------------------------------------------------------------------


def _video(scale: float = 1.0, prompt: int = 168, window: int = 3) -> dict:
    """One engine's video workload (``peer_workloads.video``'s shape): every TTFT ``scale`` times a reference."""
    cached = [{"key": f"video/cached/n{n}/r{r}", "n": n, "repeat": r, "ttft_ms": scale * (20 + 10 * n),
               "prompt_tokens": 120 * n + prompt - 120} for n in (1, 2, 4, 8) for r in range(2)]  # fmt: skip
    new = [{"key": f"video/new/r{r}", "repeat": r, "ttft_ms": scale * 60, "prompt_tokens": prompt} for r in range(3)]
    stream = [{"key": f"video/stream/t{t}", "turn": t + 1, "segments": min(t + 1, window),
               "ttft_ms": scale * (50 + 10 * min(t + 1, window)), "prompt_tokens": 120 * min(t + 1, window) + 48}
              for t in range(6)]  # fmt: skip
    return {
        "clips": "320x180, 2 s at 8 fps (h264 MP4), sampled at 2 fps",
        "cached": {
            "rows": cached,
            "ttft_p50_by_n": {n: scale * (20 + 10 * n) for n in (1, 2, 4, 8)},
            "slope": {"slope": 10.0 * scale, "ci_low": 9.0 * scale, "ci_high": 11.0 * scale},
        },  # fmt: skip
        "new": {"rows": new, "ttft_p50_ms": scale * 60},
        "stream": {"window": window, "rows": stream, "ttft_p50_after_window_ms": scale * 80},
    }


def _with_video(run: dict, video: dict | None) -> dict:
    return {**run, "video": video} if video is not None else run


def test_video_ratios_per_tp_size_once_the_prompt_tokens_agree():
    from benchmarks.peer.peer_analysis import analyze_rounds

    rounds = {"vllm": [_with_video(_run(), _video())], "mmcast_tp1": [_with_video(_run(), _video(0.6))],
              "mmcast_tp2": [_with_video(_run(), _video(1.5))]}  # fmt: skip
    a = analyze_rounds(rounds, SLO)
    r = a["ratios"]
    for key in ("video_cached_slope_ratio", "video_new_clip_ttft_ratio", "video_stream_turn_ttft_ratio"):
        assert r[key] == pytest.approx(0.6), key
        assert r[key + "_tp2"] == pytest.approx(1.5), key
    assert a["video_prompt_tokens"]["mmcast_tp1"] == {"compared": 17, "mismatches": [], "ok": True}
    assert a["video_notes"] == []
    goals = {g["name"]: g["status"] for g in a["goals"]}
    assert goals["TP1 video: TTFT slope per cached clip ≤ 1.0× vLLM's"] == "met"
    assert goals["TP1 video: live-stream turn TTFT p50 (window full) ≤ 1.0× vLLM's"] == "met"
    f = a["figures"]["mmcast_tp1"]
    assert (f["video_cached_ttft_slope_ms"], f["video_new_clip_ttft_p50_ms"], f["video_stream_turn_ttft_p50_ms"]) == (
        pytest.approx(6.0),
        pytest.approx(36.0),
        pytest.approx(48.0),
    )


def test_video_ratios_are_left_out_with_the_reason_when_frames_differ_or_vllm_failed():
    from benchmarks.peer import peer_report
    from benchmarks.peer.peer_analysis import analyze_rounds

    # mmcast TP2 sampled other frames (more prompt tokens): its video ratios are not like for like
    rounds = {"vllm": [_with_video(_run(), _video())], "mmcast_tp1": [_with_video(_run(), _video(0.6))],
              "mmcast_tp2": [_with_video(_run(), _video(0.6, prompt=288))]}  # fmt: skip
    a = analyze_rounds(rounds, SLO)
    assert a["ratios"]["video_cached_slope_ratio"] == pytest.approx(0.6)
    assert a["ratios"]["video_cached_slope_ratio_tp2"] is None
    assert a["ratios"]["cached_n2_ttft_ratio_tp2"] == pytest.approx(1.0)  # the image ratios stand
    check = a["video_prompt_tokens"]["mmcast_tp2"]
    assert not check["ok"] and check["mismatches"][0] == {"key": "video/cached/n1/r0", "mmcast_tp2": 288, "vllm": 168}
    (note,) = a["video_notes"]
    assert note.startswith("mmcast_tp2: prompt tokens differ from vLLM's") and "different frames" in note

    # vLLM could not serve the video: no ratio, the error is the note, the table names it
    failed = {"error": "BadRequestError: Error code: 400 - Failed to apply Qwen2VLProcessor | frames"}
    rounds = {"vllm": [_with_video(_run(), failed)], "mmcast_tp1": [_with_video(_run(), _video(0.6))]}
    a = analyze_rounds(rounds, SLO)
    assert all(a["ratios"][k] is None for k in ("video_cached_slope_ratio", "video_new_clip_ttft_ratio",
                                                "video_stream_turn_ttft_ratio"))  # fmt: skip
    assert a["video_notes"] == [f"vllm round 1: the video workload failed: {failed['error']}"]
    goals = {g["name"]: g["status"] for g in a["goals"]}
    assert goals["TP1 video: TTFT p50 of one new clip ≤ 1.0× vLLM's"] == "n/a"
    a["agreement"], a["stages"] = {}, {}
    table = peer_report.video_table({"vllm": rounds["vllm"][0], "mmcast_tp1": rounds["mmcast_tp1"][0]}, a)
    assert "| vllm | failed: BadRequestError" in table and "Qwen2VLProcessor / frames" in table
    assert "| mmcast_tp1 | 18.0 | 24.0 | 36.0 | 60.0 | 6.00 [5.40, 6.60] | 36.0 | 48.0 | 1008 / 168 / 408 |" in table
    assert "Video ratios: vllm round 1: the video workload failed" in table

    # a run without the video workload (--only, or vLLM not among --engines) says so
    a = analyze_rounds({"vllm": [_run()], "mmcast_tp1": [_with_video(_run(), _video())]}, SLO)
    assert a["video_notes"] == ["vllm round 1: the video workload did not run (--only, or a plan without it)"]
    assert analyze_rounds({"mmcast_tp1": [_with_video(_run(), _video())]}, SLO)["video_notes"] == [
        "vLLM did not run (--engines): no video ratio"
    ]
    assert analyze_rounds({"vllm": [_run()], "mmcast_tp1": [_run()]}, SLO)["video_notes"] == [
        "vllm round 1: the video workload did not run (--only, or a plan without it)",
        "mmcast_tp1 round 1: the video workload did not run (--only, or a plan without it)",
    ]


def test_the_tables_skip_the_workloads_a_run_left_out():
    from benchmarks.peer import peer_report
    from benchmarks.peer.peer_analysis import analyze_rounds

    only_video = {"vllm": {"video": _video(), "engine_cpu_s": {}}, "mmcast_tp1": {"video": _video(0.5)}}
    a = analyze_rounds({k: [v] for k, v in only_video.items()}, SLO)
    a["agreement"], a["stages"] = {}, {}
    text = peer_report.tables(only_video, a)
    assert "Cached images" not in text and "Sliding window" not in text and "Multi-turn chat" not in text
    assert "| mmcast_tp1 | 15.0 |" in text and "`video_cached_slope_ratio` | 0.50 |" in text
    assert peer_report.write_plots("/nonexistent", only_video, a, SLO) == []
    # a ladder neither engine was offered is no verdict, nor is a TP comparison of figures left out
    only_video["mmcast_tp2"] = {"video": _video(0.4)}
    goals = {g["name"]: g["status"] for g in analyze_rounds({k: [v] for k, v in only_video.items()}, SLO)["goals"]}
    assert goals["TP1 request throughput at the SLO ≥ 1.0× vLLM's"] == "n/a"
    assert goals["TP2 no worse than TP1 per request"] == "n/a"


def test_the_breakdown_has_a_column_for_the_sliding_window_after_it_fills():
    from benchmarks.peer import peer_report, peer_stages, peer_tables

    acc = peer_stages.new_accumulator()
    peer_stages.add(acc, {"rank_encode": (0.0, 0.0)}, {"rank_encode": (0.1, 2.0), "rank": (0.3, 2.0)})
    result = {"sliding": {"window": 4, "stages": {"4": acc}}}  # keys are strings once results.json is read back
    stages = peer_report.stage_breakdown({"vllm": [{}], "mmcast_tp1": [result]})
    assert stages["mmcast_tp1"]["sliding"]["n"] == 4 and "vllm" not in stages
    assert stages["mmcast_tp1"]["sliding"]["stages"]["rank_encode"]["mean_ms"] == pytest.approx(50.0)
    figures = {
        "mmcast_tp1": {"sliding_ttft_mean_after_window_ms": 170.0},
        "vllm": {"sliding_ttft_mean_after_window_ms": 130.0},
    }
    table = peer_tables.breakdown({}, {"figures": figures, "stages": stages})
    header = next(line for line in table.splitlines() if line.startswith("| stage |"))
    assert header.endswith("| mmcast_tp1 sliding N=4 |")
    assert "| mmcast client TTFT p50 (sliding: mean) | – | – | 170.0 |" in table
    assert "| vLLM client TTFT p50 (sliding: mean) | – | – | 130.0 |" in table


def test_engine_names_take_threads_and_stall_suffixes():
    from benchmarks.peer.compare import start_engine

    e = start_engine("mmcast_tp1_stall0", "model", "/tmp/logs")
    assert (e.tp, e.threads, e.stall_ms, e.name) == (1, None, 0, "mmcast_tp1_stall0")
    e = start_engine("mmcast_tp2_threads1_stall150", "model", "/tmp/logs")
    assert (e.tp, e.threads, e.stall_ms, e.name) == (2, 1, 150, "mmcast_tp2_threads1_stall150")
    assert start_engine("mmcast_tp1", "model", "/tmp/logs").stall_ms is None
    assert start_engine("mmcast_tp1", "model", "/tmp/logs").local_streams  # serve-local's default: the sockets
    e = start_engine("mmcast_tp1_grpc", "model", "/tmp/logs")
    assert (e.tp, e.local_streams, e.name) == (1, False, "mmcast_tp1_grpc")
    for bad in ("mmcast_tp1_stall", "mmcast_tp1_fast2", "mmcast_tp1_stall0_stall5"):
        with pytest.raises(ValueError, match="_stallMS"):
            start_engine(bad, "model", "/tmp/logs")
