"""The benchmark driver: ``python -m benchmarks.run --quick | --full | --smoke [--out DIR]``.

In one run: the transport floors, the scheduler's step time against items held, then for every configuration
(tensor-parallel size × transfer mode) a fresh local group (real processes, the embedded tiny model, loopback)
that is warmed and driven through the SDK scenarios of ``benchmarks.support.scenarios`` (and the video scenarios of
``benchmarks.transfer.videos``: cached clips, a new clip, the live stream, in the groups the plan's ``VideoPlan`` names), then
for every tensor-parallel
size × new-image variant (payload encoding + encoder placement) a fresh group driven through
``benchmarks.transfer.new_images``, the rank's forward against transformers' static batch on real-width 2-layer checkpoints
(``benchmarks.rank.rank_engine``: 2B widths in the quick plan, 2B and 7B in the full one), and (full plan) three replicas
behind one client, ring hash against round robin (``benchmarks.affinity.sdk_balancing``). All modes, and all variants, must return the same tokens (greedy, ``ignore_eos``); a
mismatch fails the run after the results are written. Output goes to
``benchmarks/results/<timestamp>-<plan>/``: ``results.json`` (machine, versions, commit, every record and figure),
``results.md`` (tables; every issue-7 target next to its measured value) and PNG plots (with matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable

from benchmarks import plots, report
from benchmarks.affinity import sdk_balancing as affinity
from benchmarks.http_api import http_overhead
from benchmarks.rank import grammar_cost
from benchmarks.support.paths import RESULTS
from benchmarks.support.run_meta import git_meta, machine_meta, versions
from benchmarks.support.scenarios import Images, Record, Session, question, user
from benchmarks.transfer import floors as floors_mod
from benchmarks.transfer import new_images, sched_steps, videos
from benchmarks.transfer.new_images import CANDIDATE, ImageSet
from benchmarks.transfer.videos import Clips, VideoPlan
from common.process import ensure_allocator_env

PIXEL_PATH = ("--payload-encoding", "pixels", "--encoder-placement", "replicated")
SEEDS = {"cached_floor": 1000, "duplicate": 5000, "conversation": 2000, "sliding_window": 3000, "warmup": 9000}


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    size: tuple[int, int]  # (width, height) of the synthetic JPEGs
    tps: tuple[int, ...]  # timed tensor-parallel sizes
    modes: tuple[str, ...]
    ns: tuple[int, ...]  # distinct images of the cached floor and duplicate control
    repeats: int  # timed follow-ups per N
    scenarios: tuple[str, ...]
    turns: int  # conversation and sliding window
    window: int  # images kept by the sliding window
    resend_modes: tuple[str, ...]  # modes that also run the resend-every-turn client
    floor_sizes: tuple[str, ...]
    floor_ranks: tuple[int, ...]
    floor_repeats: int
    step_counts: tuple[int, ...]  # items held for the scheduler step-time measurement
    correctness_tps: tuple[int, ...] = ()  # sizes run for token equality only (oversubscribed: not timed)
    max_tokens: int = 4
    kv_blocks: int = 8192
    security: bool = False  # also run benchmarks/http_api/security_load.py (hostile inputs beside a token stream)
    rank_memory_tps: tuple[int, ...] = ()  # benchmarks/rank/rank_memory.py: rank peak RSS vs plain transformers per TP
    new_image_groups: tuple[
        tuple[int, str], ...
    ] = ()  # benchmarks/transfer/new_images.py: a fresh group per (TP, variant)
    new_image_sets: tuple[ImageSet, ...] = ()
    affinity: affinity.AffinityPlan | None = (
        None  # benchmarks/affinity/sdk_balancing.py: replicas, ring hash vs round robin
    )
    rank_engine: str | None = None  # benchmarks/rank/rank_engine.py's plan: the rank's forward vs transformers' batch
    http_overhead: str | None = (
        None  # benchmarks/http_api/http_overhead.py's plan: the HTTP door against the SDK, one group
    )
    video: VideoPlan | None = (
        None  # benchmarks/transfer/videos.py: cached clips, a new clip, the live stream per (TP, mode)
    )
    grammar_rounds: int = (
        0  # benchmarks/rank/grammar_cost.py: rounds of the constrained-beside-free decode (0: skipped)
    )

    def clients(self, mode: str) -> list[str]:
        return ["sdk", "resend"] if mode in self.resend_modes else ["sdk"]


_JPEG_448, _PNG_448 = ((448, 448), "jpeg"), ((448, 448), "png")
_JPEG_720P, _PNG_720P = ((1280, 720), "jpeg"), ((1280, 720), "png")

PLANS = {
    # make test: one TP, two modes, the smallest images; only that it runs and that the modes agree is checked.
    # New images: one group (the default variant, TP1; a group costs ~5-10 s to start here), 1 and 2 new JPEGs.
    "smoke": Plan("smoke", (448, 448), (1,), ("full", "lazy"), (1, 2), 2, ("cached_floor", "sliding_window"), 3, 2,
                  ("lazy",), ("448x448",), (1, 2), 10, (10, 100), kv_blocks=1024,
                  new_image_groups=((1, CANDIDATE),), new_image_sets=(ImageSet(*_JPEG_448, (1, 2), 2),),
                  video=VideoPlan(ns=(1, 2), repeats=1, new_repeats=1, stream_turns=4, modes=("lazy",), tps=(1,)),
                  grammar_rounds=2),
    # Video (benchmarks/transfer/videos.py): one tiny pass, lazy only (the smoke's time may grow by seconds, not tens).
    # make bench-quick (<= 6 min): 448x448 keeps the 26-image prefill (6.6k tokens) cheap on 2 CPU cores; a
    # 1280x720 prompt of 26 images is 31k tokens, whose uncached prefill alone takes ~20 s per configuration here.
    # New images: 448x448 JPEG and PNG with N = 1, 4, 8; one 1280x720 JPEG per request (bytes, runs and CPU per
    # image; a 720p image costs ~1-2 s of tiny-model prefill and encoding here, so no slope in the quick plan).
    # Video: N = 1, 2, 4, 8 cached 2 s clips, 3 new clips, a 7-turn live stream, in every (TP, mode) group.
    "quick": Plan("quick", (448, 448), (1, 2), ("full", "strip", "lazy"), (2, 13, 26), 6,
                  ("cached_floor", "sliding_window"), 12, 6, ("lazy",), ("448x448", "1280x720"), (1, 2, 4), 12,
                  (10, 100, 1000, 10_000), new_image_groups=new_images.groups((1, 2)),
                  new_image_sets=(ImageSet(*_JPEG_448, (1, 4, 8), 2), ImageSet(*_PNG_448, (1, 4, 8), 1),
                                  ImageSet(*_JPEG_720P, (1,), 1)), rank_engine="quick", http_overhead="quick",
                  video=VideoPlan(), grammar_rounds=6),
    # make bench: the full matrix at 1280x720 (~30-40 min here), TP=4 for token equality only.
    "full": Plan("full", (1280, 720), (1, 2), ("full", "strip", "lazy"), (2, 8, 13, 20, 26), 5,
                 ("cached_floor", "duplicate", "conversation", "sliding_window"), 16, 8, ("full", "strip", "lazy"),
                 ("1280x720", "448x448"), (1, 2, 4), 15, (10, 100, 1000, 10_000), correctness_tps=(4,),
                 kv_blocks=16384, security=True, rank_memory_tps=(1, 2, 4),
                 new_image_groups=new_images.groups((1, 2)),
                 new_image_sets=(ImageSet(*_JPEG_448, (1, 4, 8), 3), ImageSet(*_PNG_448, (1, 4, 8), 3),
                                 ImageSet(*_JPEG_720P, (1, 4, 8), 2), ImageSet(*_PNG_720P, (1, 4, 8), 2)),
                 affinity=affinity.AffinityPlan(), rank_engine="full", http_overhead="full"),
}  # fmt: skip


def planned_requests(plan: Plan, mode: str, tp: int = 1) -> int:
    """Requests one configuration makes (for the progress bar); mirrors Session and run_config."""
    clients = len(plan.clients(mode))
    total = 2  # warm-up: SDK and resend
    for scenario in ("cached_floor", "duplicate"):
        if scenario in plan.scenarios:
            control = scenario == "cached_floor"
            total += len(plan.ns) * (1 + control + plan.repeats * (clients + control))
    total += "cached_floor" in plan.scenarios  # control calibration
    total += sum(plan.turns * clients for s in ("conversation", "sliding_window") if s in plan.scenarios)
    return total + (videos.planned_requests(plan.video) if plan.video and plan.video.runs(tp, mode) else 0)


def run_config(
    plan: Plan,
    model_dir: str,
    tp: int,
    mode: str,
    images: Images,
    on_record: Callable[[Record], None],
    correctness_only: bool = False,
    clips: Clips | None = None,
) -> dict:
    """Start a group, warm it, run the plan's scenarios; returns what the group cost to start."""
    from mmcast_local.supervisor import LocalGroup

    t0 = time.monotonic()
    load = [round(x, 2) for x in os.getloadavg()]
    # The transfer-mode scenarios measure what each mode saves on the heaviest payload: the frontend's pixel_values
    # sent to every rank (--payload-encoding pixels, --encoder-placement replicated). What the defaults cost per new
    # image is benchmarks/transfer/new_images.py's subject.
    with LocalGroup(model_dir, tp=tp, transfer_mode=mode, kv_blocks=plan.kv_blocks, scheduler_args=PIXEL_PATH) as group:
        started = time.monotonic() - t0
        session = Session(group, tp, mode, plan.max_tokens, on_record)
        try:
            warm = [user([images.path(SEEDS["warmup"])], question(0))]
            for client in ("sdk", "resend"):
                session.run(warm, scenario="warmup", kind="warm", n=1, index=0, client=client)
            if correctness_only:
                session.cached_floor("tp4_correctness", images, plan.ns[:2], 1, ["sdk"], False, SEEDS["cached_floor"])
                return {"tp": tp, "mode": mode, "startup_seconds": started, "correctness_only": True, "loadavg": load}
            clients = plan.clients(mode)
            for scenario in ("cached_floor", "duplicate"):
                if scenario in plan.scenarios:
                    session.cached_floor(
                        scenario,
                        images,
                        plan.ns,
                        plan.repeats,
                        clients,
                        control=scenario == "cached_floor",
                        seed=SEEDS[scenario],
                    )
            if "conversation" in plan.scenarios:
                session.turns("conversation", images, plan.turns, None, clients, SEEDS["conversation"])
            if "sliding_window" in plan.scenarios:
                session.turns("sliding_window", images, plan.turns, plan.window, clients, SEEDS["sliding_window"])
            if clips is not None and plan.video and plan.video.runs(tp, mode):
                t_video = time.monotonic()
                videos.run_scenarios(session, clips)
                video_seconds = time.monotonic() - t_video
        finally:
            session.close()
    out = {"tp": tp, "mode": mode, "startup_seconds": started, "seconds": time.monotonic() - t0, "loadavg": load}
    if clips is not None and plan.video and plan.video.runs(tp, mode):
        out["video_seconds"] = video_seconds  # what the video scenarios added to this group
    return out


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with transformers; the bar is a convenience
        return None
    return tqdm(total=total, unit="req", dynamic_ncols=True, file=sys.stderr)


def _planned_total(plan: Plan) -> int:
    """Requests the whole plan makes (the progress bar's length)."""
    total = sum(planned_requests(plan, m, tp) for m in plan.modes for tp in plan.tps)
    total += sum(2 + 2 * min(2, len(plan.ns)) for _ in plan.correctness_tps for _ in plan.modes)
    total += new_images.planned_requests(plan.new_image_sets) * len(plan.new_image_groups)
    if plan.http_overhead:
        total += http_overhead.planned_requests(http_overhead.PLANS[plan.http_overhead])
    return total


def _driven_groups(plan: Plan, model_dir: str, images: Images, clips: Clips | None, records: list[dict], log):
    """Every group driven through the SDK scenarios (transfer modes, TP correctness, new-image variants, the HTTP
    door); each record lands in ``records``. Returns (what each group cost, the HTTP door's result or None)."""
    configs = []
    http_result = None
    bar = _progress(_planned_total(plan))

    def on_record(rec: Record) -> None:
        records.append(dataclasses.asdict(rec))
        if bar is not None:
            bar.set_postfix_str(
                f"TP{rec.tp} {rec.variant or rec.mode} {rec.scenario} N={rec.n} {rec.ttft_ms:.0f} ms", refresh=False
            )
            bar.update(1)

    try:
        for tp in plan.tps:
            for mode in plan.modes:
                configs.append(run_config(plan, model_dir, tp, mode, images, on_record, clips=clips))
        for tp in plan.correctness_tps:
            for mode in plan.modes:
                configs.append(run_config(plan, model_dir, tp, mode, images, on_record, correctness_only=True))
        for tp, variant in plan.new_image_groups:
            configs.append(
                new_images.run_variant(
                    model_dir,
                    tp,
                    variant,
                    plan.new_image_sets,
                    images,
                    max_tokens=plan.max_tokens,
                    kv_blocks=plan.kv_blocks,
                    on_record=on_record,
                )
            )
        if plan.http_overhead:  # its own fresh group (TP1, defaults); records of its own shape, not Records
            http_result = http_overhead.measure(
                model_dir,
                images,
                http_overhead.PLANS[plan.http_overhead],
                on_request=lambda _r: bar.update(1) if bar is not None else None,
                log=log,
            )
    finally:
        if bar is not None:
            bar.close()
    return configs, http_result


def _own_measurements(plan: Plan, model_dir: str, images: Images, out_dir: str, log) -> dict:
    """The measurements that start groups or processes of their own (structured output, hostile inputs, rank memory,
    the rank's forward, replicas), each written to ``out_dir`` beside the results; None (or []) where the plan
    skips one."""
    out = {"grammar": None, "security": [], "rank_memory": None, "rank_engine": None, "affinity": None}
    if plan.grammar_rounds:  # its own fresh group (TP1): a constrained request beside an unconstrained one
        out["grammar"] = grammar_cost.measure(model_dir, rounds=plan.grammar_rounds, log=lambda _md: None)
        log("structured output beside free decoding\n" + grammar_cost.write(out_dir, out["grammar"]))
    if plan.security:
        from benchmarks.http_api import security_load

        out["security"] = security_load.measure(model_dir, log)
        log("hostile inputs beside a token stream\n" + security_load.write(out_dir, out["security"]))
    if plan.rank_memory_tps:
        from benchmarks.rank import rank_memory

        out["rank_memory"] = rank_memory.measure(list(plan.rank_memory_tps), log=log)
        log(
            "rank peak RSS, demo conversation, real-width checkpoint\n" + rank_memory.write(out_dir, out["rank_memory"])
        )
    if plan.rank_engine:
        from benchmarks.rank import rank_engine

        out["rank_engine"] = rank_engine.measure(rank_engine.PLANS[plan.rank_engine], log=log)
        log("the rank's forward against transformers' static batch\n" + rank_engine.write(out_dir, out["rank_engine"]))
    if plan.affinity:
        out["affinity"] = affinity.run(model_dir, images, plan.affinity, log)
        log("replicas: ring hash against round robin\n" + affinity.markdown(out["affinity"]))
    return out


def run(plan: Plan, out_dir: str, model_dir: str | None = None) -> dict:
    from common.tiny_model import ensure_tiny_model

    os.makedirs(out_dir, exist_ok=True)
    started = time.monotonic()
    meta = {"plan": plan.name, "plan_settings": dataclasses.asdict(plan), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "machine": machine_meta(), "versions": versions(), "git": git_meta(),
            "image_size": f"{plan.size[0]}x{plan.size[1]}"}  # fmt: skip
    log = lambda msg: print(f"[bench {time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    log(f"plan {plan.name} -> {out_dir}")
    floor_rows = floors_mod.measure_floors(sizes=plan.floor_sizes, ranks=plan.floor_ranks, repeats=plan.floor_repeats)
    floors_md = floors_mod.floors_table(floor_rows)
    log("transport floors\n" + floors_md)
    steps = sched_steps.measure_step_flatness(plan.step_counts, decode_steps=200)
    log("scheduler step time measured")
    model_dir = str(
        ensure_tiny_model(model_dir or os.path.join(RESULTS, ".model", "qwen2_vl"), replace_stale=model_dir is None)
    )
    images = Images(os.path.join(RESULTS, ".images"), plan.size)
    clips = Clips(os.path.join(RESULTS, ".videos"), plan.video) if plan.video else None
    if clips is not None:
        videos.prepare(clips)  # rendered before any group starts: not timed
    records: list[dict] = []
    configs, http_result = _driven_groups(plan, model_dir, images, clips, records, log)
    if http_result is not None:
        log("the HTTP door against the gRPC SDK\n" + http_overhead.write(out_dir, http_result))
    own = _own_measurements(plan, model_dir, images, out_dir, log)
    meta["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_seconds"] = time.monotonic() - started
    if plan.video:
        meta["video"] = {"clips": plan.video.label,
                         "seconds_in_groups": sum(c.get("video_seconds", 0.0) for c in configs)}  # fmt: skip
    analysis = report.analyze(records, floor_rows, steps, meta["image_size"])
    analysis["affinity"] = own["affinity"]
    analysis["http_overhead"] = http_result and {k: v for k, v in http_result.items() if k != "records"}
    analysis["grammar_cost"] = own["grammar"]
    figures = plots.write_plots(out_dir, analysis)
    report.write_markdown(os.path.join(out_dir, "results.md"), meta, analysis, floors_md, figures)
    results = {"meta": meta, "configs": configs, "floors": floor_rows, "analysis": analysis, "records": records,
               "security": own["security"], "rank_memory": own["rank_memory"], "rank_engine": own["rank_engine"],
               "http_overhead_records": http_result["records"] if http_result else []}  # fmt: skip
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    log(f"wrote {out_dir}/results.md, results.json and {len(figures)} plots")
    return analysis


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    for name in PLANS:
        which.add_argument(f"--{name}", dest="plan", action="store_const", const=name, help=f"the {name} plan")
    parser.add_argument("--out", help="output folder (default benchmarks/results/<timestamp>-<plan>)")
    parser.add_argument("--model-dir", help="tiny model folder (built if missing; default benchmarks/results/.model)")
    args = parser.parse_args(argv)
    plan = PLANS[args.plan or "quick"]
    out = args.out or os.path.join(RESULTS, f"{time.strftime('%Y%m%d-%H%M%S')}-{plan.name}")
    analysis = run(plan, out, args.model_dir)
    http = analysis.get("http_overhead")
    for t in analysis["targets"] + (http["targets"] if http else []):
        print(f"{t['status']:>12}  {t['name']}: {t['measured']} (target {t['target']})")
    if http and not http["equality"]["ok"]:
        print(
            f"FAILED: the HTTP door and the SDK returned different answers: {http['equality']['mismatches'][:3]}",
            file=sys.stderr,
        )
        return 1
    grammar = analysis.get("grammar_cost")
    if grammar:
        server = grammar.get("server_ratio")
        worst = max(grammar["ratio"], server if server is not None else 0.0)  # met only if both measures are
        status = "met" if worst <= grammar["target"] else "not met"
        server_text = "–" if server is None else f"{server:.2f}x"
        print(f"{status:>12}  constrained beside unconstrained, per decode step: server {server_text}, client "
              f"{grammar['ratio']:.2f}x (target <= {grammar['target']}x)")  # fmt: skip
        if not grammar["same_text"]:
            print("FAILED: a constrained request beside it changed an unconstrained greedy answer", file=sys.stderr)
            return 1
    scale_out = analysis.get("affinity")
    if scale_out and (not scale_out["tokens_equal"] or any(p["failed"] for p in scale_out["policies"])):
        print(
            "FAILED: the replicas under ring hash and round robin disagreed on tokens or failed requests",
            file=sys.stderr,
        )
        return 1
    if not analysis["equality"]["ok"]:
        print(
            f"FAILED: the transfer modes or new-image variants returned different tokens: "
            f"{analysis['equality']['mismatches'][:3]}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    ensure_allocator_env()  # re-execs this process once with the allocator settings of common/process.py
    sys.exit(main())
