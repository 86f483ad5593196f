"""The served side of the rank-engine comparison (``rank_engine.py``): one local group (TP 1, real processes) gets
all N requests of a job at once through the SDK with token streaming; the rank's own step time is read from its
``/metrics``. ``run_jobs`` takes turns with the transformers process job by job.

Each job is sent twice. The first pass gives the prefill figures and the tokens compared with transformers. Its
decode phase (after the last first token) is not a batch of N: the scheduler prefills the prompts in chunks beside
the decodes, so the first requests decode while later ones prefill and may have finished before the last one
starts. The second pass sends the same prompts again, now in the prefix cache (each recomputes only its last
block), so all N reach their first token within a step or two and decode together, as the static batch does: the
decode figures come from it (the first pass's are kept as ``staggered_*``), and its tokens must equal the first
pass's."""

from __future__ import annotations

import os
import re
import threading
import time
import urllib.request

from benchmarks.rank.rank_engine_jobs import Job
from benchmarks.rank.rank_engine_reference import Reference
from benchmarks.rank.rank_engine_report import rate


def _step_seconds(url: str) -> tuple[float, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = float(re.search(r"^mmcast_worker_step_seconds_sum (\S+)$", text, re.M).group(1))
    count = float(re.search(r"^mmcast_worker_step_seconds_count (\S+)$", text, re.M).group(1))
    return total, count


def serve_job(client, rank_metrics: str, job: Job, reqs: list[tuple[str, list[int]]]) -> dict:
    """All requests at once, streamed; returns the phase times, the tokens and the rank's step time."""
    n = len(reqs)
    first = [0.0] * n
    times: list[list[float]] = [[] for _ in range(n)]
    tokens: list[list[int]] = [[] for _ in range(n)]
    errors: list[BaseException] = []
    all_first = threading.Event()
    lock = threading.Lock()
    scrape: dict = {}

    def one(i: int) -> None:
        try:
            stream = client.generate(
                reqs[i][0], max_tokens=job.new_tokens, temperature=0.0, ignore_eos=True, stream=True
            )
            for delta in stream:
                now = time.perf_counter()
                times[i] += [now] * len(delta.token_ids)
                tokens[i] += delta.token_ids
                with lock:
                    if not first[i]:
                        first[i] = now
                        if all(first):
                            scrape["start"] = (now, _step_seconds(rank_metrics))
                            all_first.set()
            served = stream.result.usage.prompt_tokens
            if served != len(reqs[i][1]):  # the reference must run the very prompt the frontend built
                raise RuntimeError(
                    f"request {i}: the server counted {served} prompt tokens, the reference has {len(reqs[i][1])}"
                )
        except BaseException as exc:  # reported after the join
            errors.append(exc)
            all_first.set()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    end = max(ts[-1] for ts in times)
    steps_end = _step_seconds(rank_metrics)
    t_first, steps_start = scrape["start"]
    decode_tokens = sum(sum(1 for t in ts if t > t_first) for ts in times)
    decode_steps = steps_end[1] - steps_start[1]
    return {
        "prompt_tokens": sum(len(r[1]) for r in reqs),
        "new_tokens": sum(len(t) for t in tokens),
        "prefill_seconds": t_first - t0,
        "decode_tokens": decode_tokens,
        "decode_seconds": end - t_first,
        "total_seconds": end - t0,
        "rank_step_ms": 1e3 * (steps_end[0] - steps_start[0]) / decode_steps if decode_steps else None,
        "rank_decode_steps": decode_steps,
        "tokens": tokens,
    }


_DECODE_KEYS = ("decode_tokens", "decode_seconds", "rank_step_ms", "rank_decode_steps")


def run_jobs(
    model: str, jobs: list[tuple[Job, list]], log, env: dict | None = None, worker_args: tuple[str, ...] = ()
) -> list[tuple[dict, dict]]:
    """(served, transformers) per job, the two taking turns."""
    from mmcast_client.client import Client
    from mmcast_local.supervisor import LocalGroup

    peak = max(sum(len(ids) + j.new_tokens for _, ids in reqs) for j, reqs in jobs)
    # The largest job twice over: its first pass's blocks stay in the prefix cache for the second, which allocates
    # its new tokens' blocks beside them.
    blocks = 2 * (peak // 16 + 64 * 4)
    out = []
    reference = Reference(model)
    # The rank takes every CPU, as the transformers process does: the two take turns, never run at once, and the
    # question is the forward's. (serve-local leaves one CPU to the scheduler: MMCAST_RESERVED_CPUS=1.)
    env = {**(os.environ if env is None else env), "MMCAST_RESERVED_CPUS": "0"}
    try:
        # A long prefill step on a loaded 2-core machine can outlast the scheduler's default step timeout (120 s),
        # which would count the group as lost and restart it mid-job.
        with (
            LocalGroup(
                model,
                tp=1,
                kv_blocks=blocks,
                env=env,
                ready_timeout=900,
                worker_args=worker_args,
                scheduler_args=("--step-timeout-seconds", "1800"),
            ) as group,
            Client(group.target, timeout=3600, first_token_timeout=3600) as client,
        ):
            rank = group.metrics_urls["rank0"]
            client.generate("warm up", max_tokens=2, ignore_eos=True)
            for job, reqs in jobs:
                served = serve_job(client, rank, job, reqs)
                again = serve_job(client, rank, job, reqs)  # the prompts cached: N decode together
                for key in _DECODE_KEYS:
                    served[f"staggered_{key}"] = served[key]
                    served[key] = again[key]
                served["decode_pass_equal"] = sum(
                    a == b for a, b in zip(served["tokens"], again["tokens"], strict=True)
                )
                plain = reference.run(job, reqs)
                log(
                    f"{job.name} N={job.n}: decode tok/s mmcast {rate(served, 'decode'):.1f} (rank step "
                    f"{served['rank_step_ms']:.1f} ms), transformers {rate(plain, 'decode'):.1f} (step "
                    f"{plain['step_ms']:.1f} ms); prefill tok/s {rate(served, 'prefill'):.0f} / "
                    f"{rate(plain, 'prefill'):.0f}"
                )
                out.append((served, plain))
    finally:
        reference.close()
    return out
