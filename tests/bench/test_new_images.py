"""The new_images benchmark's analysis on synthetic records: per-image figures, ratios against the baseline, the
issue-15 targets (met and missed), token equality across variants, fields a build does not report, the request
plan and the counter deltas it reads."""

from __future__ import annotations

import random

import pytest

from benchmarks import report
from benchmarks.support.scenarios import Scraper, parse_metrics
from benchmarks.transfer import new_images
from benchmarks.transfer.new_images import BASELINE, CANDIDATE, ImageSet

PIXELS_448 = 1024 * 1176 * 4  # float32 pixel_values of one 448x448 image
JPEG = 40_000
# Per new image at TP2: (payload bytes summed over ranks, encoder runs, collective bytes, scheduler CPU s, TTFT ms)
COSTS = {
    BASELINE: (2 * PIXELS_448, 2, 0, 0.018, 60.0),
    "encoded+replicated": (2 * JPEG, 2, 0, 0.002, 45.0),
    CANDIDATE: (JPEG, 1, 256 * 128 * 4, 0.001, 30.0),
}


def _records(costs=COSTS, tp=2, image="448x448 jpeg", tokens=lambda n, r: [n, r], seed=0, fields=True):
    rng = random.Random(seed)
    out = []
    for variant, (payload, runs, shared, cpu, ttft) in costs.items():
        for r in (1, 2):
            for n in (1, 4, 8):
                usage = {"prompt_tokens": 300 * n, "images_sent": n * tp, "payload_bytes_broadcast": payload * n}
                metrics = {"payload_bytes": payload * n + 50 * n, "worker_payload_bytes": payload * n + 50 * n,
                           "metadata_bytes": 100 * n, "worker_metadata_bytes": 100 * n,
                           "scheduler_cpu_seconds": 0.03 + cpu * n + rng.gauss(0, 1e-4),
                           "rank_cpu_seconds": 0.1 + 0.05 * n,
                           "encoder_runs": runs * n if fields else None,
                           "encoder_output_shared_bytes": shared * n if fields else None,
                           "worker_collective_bytes": shared * n * (tp - 1) if fields else None,
                           "worker_collective_seconds_sum": 0.001 * n if fields else None,
                           "worker_preprocess_seconds_sum": 0.004 * n if fields else None}  # fmt: skip
                if fields:
                    usage.update(
                        encoder_runs=runs * n, encoder_output_bytes_shared=shared * n, image_cpu_seconds=cpu * n / 2
                    )
                out.append({"scenario": "new_images", "kind": "image", "client": "sdk", "tp": tp, "mode": "lazy",
                            "n": n, "index": r, "ttft_ms": 40 + ttft * n + rng.gauss(0, 0.5), "server_ttft_ms": 0,
                            "total_ms": 0, "token_ids": tokens(n, r), "usage": usage, "metrics": metrics,
                            "variant": variant, "image": image, "image_bytes": JPEG * n})  # fmt: skip
    return out


FLOORS = [{"transport": t, "size": "448x448", "ranks": 2, "p50_ms": ms} for t, ms in (("grpc", 9.3), ("shm", 1.1))]


def test_per_image_figures_ratios_and_targets_met():
    a = report.analyze(_records(), FLOORS, None, "448x448")
    rows = {r["variant"]: r for r in a["new_images"]["rows"]}
    assert list(rows) == list(new_images.VARIANTS)  # the report's order: baseline first
    cand = rows[CANDIDATE]
    assert cand["payload_bytes_usage"] == JPEG and cand["payload_bytes_wire"] == JPEG + 50
    assert cand["encoder_runs"] == 1 and rows[BASELINE]["encoder_runs"] == 2
    assert cand["collective_bytes"] == 256 * 128 * 4 and cand["collective_bytes_workers"] == 256 * 128 * 4
    assert cand["scheduler_cpu_ms"]["slope"] == pytest.approx(1.0, abs=0.05)
    assert cand["ttft_ms"]["slope"] == pytest.approx(30.0, abs=0.5) and cand["ttft_ms"]["n"] == 6
    assert cand["frontend_image_cpu_ms"] == pytest.approx(0.5)
    assert cand["floor_grpc_ms"] == 9.3 and cand["floor_shm_ms"] == 1.1
    (c,) = a["new_images"]["comparisons"]
    assert c["bytes"] == pytest.approx((2 * PIXELS_448 + 50) / (JPEG + 50))
    assert c["cpu"] == pytest.approx(18.0, rel=0.1) and c["ttft"] == pytest.approx(2.0, rel=0.05)
    status = {t["name"]: t["status"] for t in a["targets"]}
    fresh = [n for n in status if n.startswith(f"{CANDIDATE} vs {BASELINE}, TP2")]
    assert len(fresh) == 3 and all(status[n] == "met" for n in fresh)
    assert a["equality"]["ok"] and a["equality"]["checked"] == 6  # each (n, repeat) across the three variants
    text = new_images.markdown(a["new_images"])
    assert "| 2 | 448x448 jpeg | encoded+sharded | 40.0 kB | 40.0 kB / 40.0 kB | 1.00 | 0.13 MB |" in text


def test_misses_and_token_mismatches_are_reported():
    costs = dict(COSTS)
    costs[CANDIDATE] = (JPEG, 1, 0, 0.009, 50.0)  # CPU only 2x lower, TTFT 1.2x
    recs = _records(costs, tokens=lambda n, r: [n, r])
    wrong = next(r for r in recs if r["variant"] == CANDIDATE and r["n"] == 4 and r["index"] == 2)
    wrong["token_ids"] = [7, 7]
    a = report.analyze(recs, [], None, "448x448")
    status = {t["name"].split(": ", 1)[1]: t["status"] for t in a["new_images"]["targets"]}
    assert status["scheduler CPU per new image"] == "MISSED"
    assert status["TTFT slope per new image"] == "MISSED"
    assert status["payload bytes per new image, scheduler→ranks (448x448 jpeg)"] == "met"
    assert not a["equality"]["ok"]
    (m,) = a["equality"]["mismatches"]
    assert m["key"]["image"] == "448x448 jpeg" and m["key"]["n"] == 4
    assert m["tokens"][CANDIDATE] == [7, 7] and m["tokens"][BASELINE] == [4, 2]


def test_fields_a_build_lacks_read_as_unmeasured_not_zero():
    a = report.analyze(_records(fields=False), [], None, "448x448")
    cand = next(r for r in a["new_images"]["rows"] if r["variant"] == CANDIDATE)
    assert cand["encoder_runs"] is None and cand["collective_bytes"] is None and cand["collective_ms"] is None
    assert cand["payload_bytes_wire"] == JPEG + 50  # what the build does count is still there
    assert "| – | – | – |" in new_images.markdown(a["new_images"])


def test_a_single_n_gives_means_and_no_slope_ratio():
    recs = [r for r in _records(image="1280x720 jpeg") if r["n"] == 1]
    a = report.analyze(recs, [], None, "1280x720")
    cand = next(r for r in a["new_images"]["rows"] if r["variant"] == CANDIDATE)
    assert cand["ttft_ms"]["n"] == 0 and cand["scheduler_cpu_ms"]["slope"] == pytest.approx(31.0, abs=0.5)
    (c,) = a["new_images"]["comparisons"]
    assert c["bytes"] is not None and c["cpu"] is None and c["ttft"] is None  # means include the fixed cost
    status = {t["name"].split(": ", 1)[1]: t["status"] for t in a["new_images"]["targets"]}
    assert status["scheduler CPU per new image"] == "not measured"
    assert status["payload bytes per new image, scheduler→ranks (448x448 jpeg)"] == "not measured"


def test_plan_seeds_are_fresh_and_the_same_in_every_group():
    sets = (ImageSet((448, 448), "jpeg", (1, 4, 8), 2), ImageSet((1280, 720), "jpeg", (1,), 1))
    plan = list(new_images.plan_requests(sets))
    assert [(k, r, n) for k, _, r, _, n in plan] == [(0, 1, 1), (1, 1, 1), (0, 1, 4), (0, 1, 8), (0, 2, 8),
                                                     (0, 2, 4), (0, 2, 1)]  # fmt: skip
    used = [s for k, _, r, j, n in plan for s in new_images.seeds(k, r, j, n)]
    warm = [s for k in range(len(sets)) for s in new_images.seeds(k, 0, 0, 1)]
    assert len(set(used + warm)) == len(used) + len(warm) == 2 * 13 + 1 + 2
    assert new_images.planned_requests(sets) == len(plan) + 1  # one warm-up request
    assert new_images.groups((1, 2)) == (
        (1, BASELINE),
        (1, CANDIDATE),
        (2, BASELINE),
        (2, "encoded+replicated"),
        (2, CANDIDATE),
    )
    with pytest.raises(ValueError, match="new-image variant"):
        new_images.groups((2,), ("pixels+sharded",))
    with pytest.raises(ValueError, match="ImageSet.fmt"):
        ImageSet((448, 448), "gif", (1,), 1)
    with pytest.raises(ValueError, match="ImageSet.ns"):
        ImageSet((448, 448), "png", (0, 4), 1)


def test_counter_deltas_tell_a_missing_metric_from_zero():
    page = ("# TYPE mmcast_broadcast_bytes counter\nmmcast_broadcast_bytes_total{kind=\"payload\"} 10\n"
            "# TYPE mmcast_broadcast_payload_bytes_saved counter\n"  # labelled, no child yet
            "# TYPE mmcast_encoder_runs counter\nmmcast_encoder_runs_total 3\n")  # fmt: skip
    later = page.replace(" 10\n", " 25\n").replace("runs_total 3", "runs_total 5")
    worker = "# TYPE mmcast_worker_preprocess_seconds histogram\nmmcast_worker_preprocess_seconds_sum 0.5\n"
    before = {"scheduler": parse_metrics(page), "rank0": parse_metrics(worker)}
    after = {"scheduler": parse_metrics(later), "rank0": parse_metrics(worker.replace("0.5", "0.75"))}
    d = Scraper.delta(before, after)
    assert d["payload_bytes"] == 15 and d["encoder_runs"] == 2
    assert d["saved_rank_bytes"] == 0  # the metric exists, nothing counted yet
    assert d["encoder_output_shared_bytes"] is None and d["metadata_bytes"] == 0
    assert d["worker_preprocess_seconds_sum"] == pytest.approx(0.25) and d["worker_collective_bytes"] is None


def test_the_plot_is_written_when_matplotlib_is_installed(tmp_path):
    from benchmarks import plots

    if not plots.available():
        pytest.skip("matplotlib is not installed (the plots are optional)")
    a = report.analyze(_records() + _records(tp=1, image="448x448 png"), FLOORS, None, "448x448")
    written = plots.write_plots(str(tmp_path), a)
    assert [p.rsplit("/", 1)[1] for p in written] == ["new_images.png"]
    assert (tmp_path / "new_images.png").stat().st_size > 10_000
