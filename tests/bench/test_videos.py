"""benchmarks/transfer/videos.py on made-up records and a recording session (no group, no real clips): the request plan, the
TTFT slope per cached clip, the live stream's steady state, the targets, the Markdown and the plot."""

from __future__ import annotations

import random

import pytest

from benchmarks.transfer import videos

CLIP_PAYLOAD = 2_260_000  # one 2 s clip's float32 pixel_values_videos at 4 frames of 168x280


def _rec(scenario, kind, mode, n, index, ttft, *, tp=1, payload=0, sent=0, runs=0, cpu=0.008, file_bytes=6000):
    return {
        "scenario": scenario, "kind": kind, "client": "sdk", "tp": tp, "mode": mode, "n": n, "index": index,
        "ttft_ms": ttft, "server_ttft_ms": ttft, "total_ms": ttft, "token_ids": [1, 2], "image": "clip",
        "image_bytes": file_bytes * n,
        "usage": {"prompt_tokens": 122 * n + 35, "cached_tokens": 122 * n + 16, "images_sent": sent, "videos": n,
                  "encoder_runs": runs, "payload_bytes_broadcast": payload, "image_cpu_seconds": cpu * n},
        "metrics": {"payload_bytes": payload, "metadata_bytes": 80 * n * tp, "worker_payload_bytes": payload,
                    "worker_metadata_bytes": 80 * n * tp},
    }  # fmt: skip


def _records(slopes=None, seed=0, tp=1):
    slopes = slopes or {"full": 18.0, "strip": 14.0, "lazy": 13.0}
    rng = random.Random(seed)
    out = []
    for mode, slope in slopes.items():
        for n in (1, 2, 4, 8):
            out.append(_rec("video_cached", "warm", mode, n, 0, 300.0, tp=tp, payload=CLIP_PAYLOAD * n * tp, sent=n))
            for r in range(1, 4):
                full = mode == "full"
                out.append(_rec("video_cached", "video", mode, n, r, 20 + slope * n + rng.gauss(0, 0.2), tp=tp,
                                payload=CLIP_PAYLOAD * n * tp if full else 0, sent=n * tp if full else 0))  # fmt: skip
        for r in range(1, 4):
            out.append(_rec("video_new", "video", mode, 1, r, 45.0 + r, tp=tp, payload=CLIP_PAYLOAD * tp, sent=tp,
                            runs=tp))  # fmt: skip
        for t in range(7):
            kept = min(t + 1, 3)
            # lazy: only the new segment travels; full and strip resend the window once the prefix stops matching
            sent = 1 if mode == "lazy" or t < 3 else kept
            out.append(_rec("video_stream", "video", mode, kept, t, 80.0 + t, tp=tp, payload=CLIP_PAYLOAD * sent * tp,
                            sent=sent * tp, runs=tp, file_bytes=7000))  # fmt: skip
    return out


def test_cached_clips_give_the_slope_per_clip_and_zero_payload_in_strip_and_lazy():
    a = videos.analyze(_records())
    by = {r["mode"]: r for r in a["cached"]}
    assert [r["mode"] for r in a["cached"]] == ["full", "strip", "lazy"]  # the modes' order, not the alphabet's
    assert by["full"]["slope"]["slope"] == pytest.approx(18.0, abs=0.2)
    assert by["lazy"]["slope"]["slope"] == pytest.approx(13.0, abs=0.2)
    assert by["lazy"]["slope"]["ci_low"] < 13.0 < by["lazy"]["slope"]["ci_high"]
    assert by["full"]["payload_bytes_by_n"][8] == 8 * CLIP_PAYLOAD
    assert set(by["lazy"]["payload_bytes_by_n"].values()) == set(by["strip"]["payload_bytes_by_n"].values()) == {0}
    assert by["lazy"]["requests"] == 12  # warm-ups are not timed
    assert by["lazy"]["prompt_tokens_by_n"][8] == 122 * 8 + 35
    assert by["lazy"]["frontend_cpu_ms_per_clip"] == pytest.approx(8.0)
    (new,) = [r for r in a["new"] if r["mode"] == "lazy"]
    assert (new["requests"], new["ttft_p50_ms"], new["encoder_runs"]) == (3, 47.0, 1)
    assert new["payload_bytes"] == CLIP_PAYLOAD


def test_the_live_stream_is_judged_after_the_window_filled():
    a = videos.analyze(_records(tp=2))
    by = {r["mode"]: r for r in a["stream"]}
    lazy, full = by["lazy"], by["full"]
    assert (lazy["window"], lazy["turns"], lazy["steady_turns"]) == (3, 7, 4)  # turns 4..7 drop the oldest segment
    assert lazy["ttft_p50_after_window_ms"] == pytest.approx(84.5)  # median of turns index 3..6: 83, 84, 85, 86
    assert lazy["payload_bytes_per_turn"] == 2 * CLIP_PAYLOAD and full["payload_bytes_per_turn"] == 6 * CLIP_PAYLOAD
    assert (lazy["deliveries_per_turn"], full["deliveries_per_turn"]) == (2, 6)
    assert lazy["encoder_runs_per_turn"] == 2
    assert lazy["deliveries_per_segment_rank"] == 1.0 and full["deliveries_per_segment_rank"] > 1.0
    assert lazy["segment_file_bytes"] == 7000
    status = {t["name"]: t["status"] for t in a["targets"]}
    assert status == {"strip/lazy: payload bytes of fully cached videos": "met",
                      "lazy live stream: payload deliveries per segment per rank": "met"}  # fmt: skip


def test_misses_are_reported_and_absent_counters_read_none():
    recs = _records()
    for r in recs:
        if r["scenario"] == "video_cached" and r["mode"] == "lazy" and r["kind"] == "video" and r["n"] == 4:
            r["metrics"]["payload_bytes"] = 99  # a cached clip's payload resent
        if r["scenario"] == "video_stream" and r["mode"] == "lazy" and r["index"] == 5:
            r["usage"]["images_sent"] = 3
        if r["scenario"] == "video_new":
            del r["usage"]["encoder_runs"]  # a build without the counter
    a = videos.analyze(recs)
    status = {t["name"]: t["status"] for t in a["targets"]}
    assert status["strip/lazy: payload bytes of fully cached videos"] == "MISSED"
    assert status["lazy live stream: payload deliveries per segment per rank"] == "MISSED"
    assert all(r["encoder_runs"] is None for r in a["new"])
    assert "| – |" in videos.markdown(a)
    assert videos.analyze([]) == {"cached": [], "new": [], "stream": [], "targets": []}
    assert videos.markdown(videos.analyze([])) == ""


def test_markdown_has_a_row_per_configuration_and_the_run_report_carries_it(tmp_path):
    from benchmarks import report

    recs = _records() + _records(tp=2, seed=1)
    text = videos.markdown(videos.analyze(recs), "320x180 2s@8fps mp4, sampled 2 fps")
    assert "TTFT N=8" in text and "slope ms/clip" in text and "payload N=8" in text
    assert text.count("| 2 | lazy |") == 3  # cached, new, stream
    assert "18.08 MB" in text  # full at N=8, TP1: 8 clips of pixel_values
    a = report.analyze(recs, [], None, "448x448")
    assert a["videos"]["cached"] and any(t["name"].endswith("fully cached videos") for t in a["targets"])
    assert a["equality"]["checked"] > 0 and a["equality"]["ok"]  # video requests compared across the modes
    meta = {"plan": "unit", "timestamp": "now", "image_size": "448x448", "wall_seconds": 1.0,
            "machine": {"cpu": "cpu", "cores": 2, "memory_gib": 24.0, "loadavg_before": [0, 0, 0]},
            "git": {"commit": "0" * 40, "dirty": False}, "versions": {"torch": "x", "transformers": "y", "grpcio": "z"},
            "video": {"clips": "320x180 2s@8fps mp4, sampled 2 fps", "seconds_in_groups": 3.0}}  # fmt: skip
    report.write_markdown(str(tmp_path / "results.md"), meta, a, "| floors |", [])
    md = (tmp_path / "results.md").read_text()
    assert "## Videos: cached clips, a new clip, the live stream" in md and "sampled 2 fps" in md


def test_plot_renders_when_matplotlib_is_installed(tmp_path):
    from benchmarks import plots

    if not plots.available():
        pytest.skip("matplotlib is not installed (the plots are optional)")
    assert videos.plot(str(tmp_path), videos.analyze(_records())).endswith("videos.png")
    assert videos.plot(str(tmp_path), videos.analyze([])) is None


class _Session:
    """Records what run_scenarios asks for instead of sending it."""

    def __init__(self) -> None:
        self.calls = []

    def run(self, messages, **kw):
        self.calls.append((messages, kw))


class _Clips(videos.Clips):
    """Small stand-in files instead of encoded MP4s."""

    def path(self, seed: int, index: int = 0) -> str:
        p = f"{self.directory}/{seed}-{index}.mp4"
        with open(p, "wb") as f:
            f.write(b"x" * (100 + index))
        return p


def test_the_scenarios_send_the_planned_requests_with_the_window_and_the_sampling(tmp_path):
    plan = videos.VideoPlan(ns=(1, 2, 4), repeats=2, new_repeats=2, stream_turns=5, window=3, sample_fps=2.0)
    session = _Session()
    videos.run_scenarios(session, _Clips(str(tmp_path), plan))
    assert len(session.calls) == videos.planned_requests(plan) == 3 * 3 + 2 + 5
    stream = [(m, kw) for m, kw in session.calls if kw["scenario"] == "video_stream"]
    assert [kw["n"] for _, kw in stream] == [1, 2, 3, 3, 3]
    last = [p for p in stream[-1][0][0]["content"] if p["type"] == "video"]
    assert [p["video"].rsplit("/", 1)[1] for p in last] == [f"{videos.SEEDS['stream']}-{i}.mp4" for i in (2, 3, 4)]
    assert all(p["fps"] == 2.0 for p in last) and stream[-1][1]["image_bytes"] == 102 + 103 + 104
    cached = [kw for _, kw in session.calls if kw["scenario"] == "video_cached"]
    assert [kw["kind"] for kw in cached[:3]] == ["warm"] * 3
    assert [kw["n"] for kw in cached[3:]] == [1, 2, 4, 4, 2, 1]  # the order of N alternates by round
    assert plan.runs(1, "lazy") and not videos.VideoPlan(modes=("lazy",)).runs(1, "full")
    with pytest.raises(ValueError):
        videos.VideoPlan(ns=())
