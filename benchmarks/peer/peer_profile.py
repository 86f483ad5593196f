"""Where mmcast's time goes in the side-by-side workloads: ``benchmarks/peer/compare.py --profile``.

A fresh mmcast TP 1 group runs the new-image workload and the load workload at the ladder's second rate once more,
with py-spy (from ``.venv-peer``) sampling the scheduler and the rank (100 Hz, native frames off, idle threads
off, so a sample is a thread on the CPU or holding the GIL). Output under ``profile/``: each process's collapsed
stacks (``<name>.txt``, the input of any flame-graph tool), and a table per process of the functions with the
most samples, inclusive (the function and what it calls) and self. These runs are not timed figures: the sampler
takes CPU from the same 2 cores.
"""

from __future__ import annotations

import asyncio
import collections
import os
import signal
import subprocess
import time

from benchmarks.peer import peer_workloads
from benchmarks.peer.peer_client import Client
from benchmarks.peer.peer_engines import PEER_VENV, Mmcast

RATE_HZ = 100
TOP = 14
# Frames every sample of a thread passes through (thread start, event loop, module call plumbing): left out of the
# inclusive table, which is about the work.
_PLUMBING = ("threading.py", "futures/thread.py", "asyncio/", "modules/module.py", "utils/_contextlib.py",
             "utils/generic.py", "utils/output_capturing.py", "modeling_layers.py", "mmcast-scheduler", "mmcast-worker",
             "selectors.py", "socketserver.py")  # fmt: skip


def _frame_name(frame: str) -> str:
    # py-spy's raw frame: "function (path/to/file.py:line)"; the line is dropped so a function is one entry
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    parts = path.split("/")
    for anchor in ("site-packages", "scheduler_svc", "worker_svc", "common", "mmcast_local"):
        if anchor in parts:
            path = "/".join(parts[parts.index(anchor) + (anchor == "site-packages") :])
            break
    else:
        path = "/".join(parts[-2:])
    return f"{name} ({path})"


def summarise(path: str) -> dict:
    inclusive: collections.Counter = collections.Counter()
    self_time: collections.Counter = collections.Counter()
    threads: collections.Counter = collections.Counter()
    total = 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            frames = stack.split(";")
            total += n
            threads[frames[0]] += n  # with --threads, the first frame names the thread
            names = [_frame_name(fr) for fr in frames[1:]] or [frames[0]]
            for name in set(names):
                if not any(p in name for p in _PLUMBING):
                    inclusive[name] += n
            self_time[names[-1]] += n
    return {
        "samples": total,
        "threads": threads.most_common(6),
        "inclusive": inclusive.most_common(TOP),
        "self": self_time.most_common(TOP),
    }


def _markdown(summaries: dict, seconds: float) -> str:
    lines = []
    for name, s in summaries.items():
        total = max(s["samples"], 1)
        busy = s["samples"] / (RATE_HZ * seconds) if seconds else 0
        lines += [f"**{name}**: {s['samples']} samples in {seconds:.0f} s (~{busy:.2f} threads busy on average); by "
                  "thread: " + ", ".join(f"{t} {100 * n / total:.0f} %" for t, n in s["threads"]), "",
                  "| inclusive | function | | self | function |", "|---:|---|---|---:|---|"]  # fmt: skip
        for (fi, ni), (fs, ns) in zip(s["inclusive"], s["self"], strict=False):
            lines.append(f"| {100 * ni / total:.1f} % | `{fi}` | | {100 * ns / total:.1f} % | `{fs}` |")
        lines.append("")
    return "\n".join(lines)


def run(plan, model_dir: str, parts, out_dir: str, log) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    spy = os.path.join(PEER_VENV, "bin", "py-spy")
    if not os.path.exists(spy):
        raise FileNotFoundError(f"{spy} is missing: run `bash scripts/install-vllm-peer.sh`")
    with Mmcast(model_dir, 1, os.path.join(out_dir, "logs")) as engine:
        pids = {"scheduler": engine.pids["scheduler"], "rank0": engine.pids["rank0"]}

        async def workloads() -> None:
            client = Client(engine.base_url)
            try:
                await peer_workloads.warmup(client, parts)
                spies = [subprocess.Popen([spy, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw",
                                           "--threads", "--nonblocking", "-o", os.path.join(out_dir, f"{name}.txt")],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                         for name, pid in pids.items()]  # fmt: skip
                await asyncio.sleep(1.0)  # the sampler attaches
                t0 = time.monotonic()
                texts: dict = {}
                size = plan.new_sizes[0]
                await peer_workloads.new_images(
                    client, parts, [size], plan.new_ns[f"{size[0]}x{size[1]}"], 1, plan.max_tokens, texts
                )
                # the ladder's second rate: loaded, yet not far past the limit, where a profile of queueing says
                # little (the ladder's higher rates are there to fail)
                await peer_workloads.load(client, parts, plan.load, min(1, len(plan.load.rates) - 1), texts)
                nonlocal seconds
                seconds = time.monotonic() - t0
                for p in spies:
                    p.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
                for p in spies:
                    p.wait(timeout=60)
            finally:
                await client.close()

        seconds = 0.0
        asyncio.run(workloads())
    summaries = {name: summarise(os.path.join(out_dir, f"{name}.txt")) for name in pids}
    log(f"profiled mmcast TP1 for {seconds:.0f} s -> {out_dir}")
    return {"seconds": seconds, "summaries": summaries, "markdown": _markdown(summaries, seconds)}
