"""The ``affinity`` scenario: several replicas behind one SDK `Client`, ring hash against round robin (issue 16).

Three local replicas (``LocalGroup``, TP=1 each, the defaults) on one multi-address target
(``ipv4:127.0.0.1:p1,...``). For each balancing policy — the SDK's default ring hash on ``x-mmcast-affinity``, and
gRPC's ``round_robin`` chosen through ``Client(options=...)`` — C conversations × T turns, a new synthetic image
per turn and uploads on, run four at a time through one client (fresh conversations per policy, so neither sees
the other's cache). Per policy:

- prefix-cache hit rate: Σ ``Usage.cached_tokens`` / Σ ``Usage.prompt_tokens`` over turns 2..T (turn 1 has no
  prefix anywhere);
- image bytes the client sent (uploads plus images sent inline, counted by a client interceptor: the SDK's
  ``interceptors=``) and the replicas' scheduler→ranks payload bytes (``Usage.payload_bytes_broadcast``);
- Generate calls per request (> 1: a replica missed an upload made on another and the SDK retried inline);
- client TTFT p50/p95 (``Result.ttft_seconds``: uploads and retries included) and requests that failed;
- requests each replica finished (``mmcast_requests_finished_total``): ring hashing has no load bound.

Before the first policy every replica serves a few warm-up requests, so neither policy pays the replicas' cold start.

Each policy runs its own conversations, so token equality (greedy, ``ignore_eos``) is checked by running the
ring-hash set's first conversation once more under round robin: the tokens must not depend on the replica.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import urllib.request
from collections.abc import Callable

import grpc

from benchmarks.support import stats

POLICIES = {"ring_hash": (), "round_robin": (("grpc.lb_policy_name", "round_robin"),)}
SEED = 90_000  # far from the other scenarios' seeds (benchmarks.run.SEEDS)
OPENING = (
    "Conversation {n}. Describe this picture: the colours, the shapes and the light, and keep a list of every "
    "colour you have seen so far in this conversation."
)
FOLLOW_UP = "Picture {t} of conversation {n}: what changed since the previous one?"


@dataclasses.dataclass(frozen=True)
class AffinityPlan:
    replicas: int = 3
    conversations: int = 24
    turns: int = 4
    size: tuple[int, int] = (448, 448)
    concurrency: int = 4  # conversations in flight at once
    max_tokens: int = 4


class _Bytes(grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """Counts the image bytes the client sends: upload chunks and inline images in Generate requests."""

    def __init__(self) -> None:
        self.upload_bytes = 0
        self.inline_bytes = 0
        self.generate_calls = 0

    def intercept_unary_stream(self, continuation, details, request):
        if details.method.endswith("/Generate"):
            self.generate_calls += 1
            self.inline_bytes += sum(len(p.image.data) for m in request.messages for p in m.content)
        return continuation(details, request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        def counted():
            for chunk in request_iterator:
                self.upload_bytes += len(chunk.data)
                yield chunk

        return continuation(details, counted())


def _conversation(client, images, plan: AffinityPlan, n: int) -> list[dict]:
    from mmcast_client import MmcastError

    history, rows = [], []
    for t in range(plan.turns):
        text = OPENING.format(n=n) if t == 0 else FOLLOW_UP.format(n=n, t=t)
        history.append({"role": "user", "content": [{"type": "image", "path": images.path(SEED + 10 * n + t, plan.size)},
                                                    {"type": "text", "text": text}]})  # fmt: skip
        try:
            r = client.generate(history, max_tokens=plan.max_tokens, ignore_eos=True, temperature=0.0)
        except MmcastError as e:
            rows.append({"n": n, "turn": t, "failed": f"{e.code.name}: {e.message[:200]}"})
            return rows
        rows.append({"n": n, "turn": t, "failed": None, "tokens": list(r.token_ids), "ttft_ms": r.ttft_seconds * 1e3,
                     "prompt_tokens": r.usage.prompt_tokens, "cached_tokens": r.usage.cached_tokens,
                     "payload_bytes": r.usage.payload_bytes_broadcast, "encoder_runs": r.usage.encoder_runs})  # fmt: skip
        history.append({"role": "assistant", "content": r.text})
    return rows


def _finished(groups) -> list[float]:
    from benchmarks.support.scenarios import parse_metrics

    out = []
    for g in groups:
        with urllib.request.urlopen(g.metrics_urls["scheduler"], timeout=10) as reply:
            metrics = parse_metrics(reply.read().decode())
        out.append(metrics.get(("mmcast_requests_finished_total", None, None), 0.0))  # summed over reasons
    return out


def _warm(groups, images, plan: AffinityPlan) -> None:
    """Two one-turn requests on every replica (one client per replica), new images each."""
    from mmcast_client import Client

    for i, g in enumerate(groups):
        with Client(g.target, timeout=600) as client:
            for k in range(2):
                path = images.path(SEED - 100 - 10 * i - k, plan.size)
                client.generate("Warm-up: describe it.", images=[path], max_tokens=plan.max_tokens, ignore_eos=True)


def run_policy(target: str, policy: str, images, plan: AffinityPlan, first: int, groups=()) -> dict:
    from mmcast_client import Client

    before = _finished(groups)
    counter = _Bytes()
    t0 = time.monotonic()
    with Client(target, options=POLICIES[policy], interceptors=[counter], timeout=600) as client:
        with concurrent.futures.ThreadPoolExecutor(plan.concurrency) as pool:
            futures = [pool.submit(_conversation, client, images, plan, first + i) for i in range(plan.conversations)]
            rows = [row for f in futures for row in f.result()]
    per_replica = [int(a - b) for a, b in zip(_finished(groups), before, strict=True)]
    ok = [r for r in rows if r["failed"] is None]
    later = [r for r in ok if r["turn"] > 0]
    ttft = [r["ttft_ms"] for r in ok]
    return {
        "policy": policy,
        "seconds": time.monotonic() - t0,
        "requests": plan.conversations * plan.turns,
        "failed": sum(r["failed"] is not None for r in rows),
        "errors": sorted({r["failed"] for r in rows if r["failed"]})[:3],
        "hit_rate": sum(r["cached_tokens"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later)),
        "upload_bytes": counter.upload_bytes,
        "inline_bytes": counter.inline_bytes,
        "generate_calls": counter.generate_calls,
        "payload_bytes": sum(r["payload_bytes"] for r in ok),
        "encoder_runs": sum(r["encoder_runs"] for r in ok),
        "ttft_p50_ms": stats.percentile(ttft, 50) if ttft else None,
        "ttft_p95_ms": stats.percentile(ttft, 95) if ttft else None,
        "per_replica": per_replica,
        "rows": rows,
    }


def run(model_dir: str, images, plan: AffinityPlan, log: Callable[[str], None]) -> dict:
    """Starts the replicas, runs every policy, and checks that the policies agree on one conversation's tokens."""
    from mmcast_local.supervisor import LocalGroup

    groups = [LocalGroup(model_dir, 1, "lazy").start() for _ in range(plan.replicas)]
    try:
        for g in groups:
            g.wait_ready()
        target = "ipv4:" + ",".join(g.target for g in groups)
        _warm(groups, images, plan)
        results = []
        for k, policy in enumerate(POLICIES):
            results.append(run_policy(target, policy, images, plan, first=1000 * (k + 1), groups=groups))
            r = results[-1]
            log(f"affinity {policy}: hit rate {r['hit_rate']:.1%}, {r['failed']} failed, "
                f"{r['generate_calls']} Generate calls for {r['requests']} requests")  # fmt: skip
        # Token equality across policies: the first conversation of the ring-hash set again, round-robin.
        again = run_policy(
            target, "round_robin", images, dataclasses.replace(plan, conversations=1), first=1000, groups=groups
        )
        want = [r.get("tokens") for r in results[0]["rows"] if r["n"] == 1000]
        equal = want == [r.get("tokens") for r in again["rows"]]
    finally:
        for g in groups:
            g.stop()
    return {"plan": dataclasses.asdict(plan), "policies": results, "tokens_equal": equal}


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def markdown(result: dict | None) -> str:
    if not result:
        return ""
    p = result["plan"]
    lines = [
        f"{p['replicas']} replicas (TP=1 each), one `Client` on a multi-address target; {p['conversations']} "
        f"conversations × {p['turns']} turns, a new {p['size'][0]}x{p['size'][1]} JPEG per turn, uploads on, "
        f"{p['concurrency']} conversations in flight. Hit rate: cached / prompt tokens over turns 2..{p['turns']}. "
        "Client image bytes: uploads + images inline in Generate requests. Payload: scheduler→ranks bytes "
        "(`Usage.payload_bytes_broadcast`). Generate calls above the request count are inline retries after a "
        f"replica missed an upload. Same tokens under both policies: {'yes' if result['tokens_equal'] else 'NO'}.",
        "",
        "| policy | hit rate | client image bytes (upload + inline) | payload to ranks | encoder runs | Generate calls "
        "/ requests | requests per replica | TTFT p50 ms | TTFT p95 ms | failed |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["policies"]:
        client_bytes = (
            f"{_mb(r['upload_bytes'] + r['inline_bytes'])} ({_mb(r['upload_bytes'])} + {_mb(r['inline_bytes'])})"
        )
        p50 = f"{r['ttft_p50_ms']:.1f}" if r["ttft_p50_ms"] is not None else "–"
        p95 = f"{r['ttft_p95_ms']:.1f}" if r["ttft_p95_ms"] is not None else "–"
        lines.append(
            f"| {r['policy']} | {r['hit_rate']:.1%} | {client_bytes} | {_mb(r['payload_bytes'])} | {r['encoder_runs']} "
            f"| {r['generate_calls']} / {r['requests']} | {' / '.join(map(str, r['per_replica']))} | {p50} | {p95} "
            f"| {r['failed']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.affinity.sdk_balancing [--out DIR]`: this scenario alone (`make bench` runs it with the rest)."""
    import argparse
    import json
    import os
    import sys

    from benchmarks.support.paths import RESULTS
    from benchmarks.support.scenarios import Images
    from common.tiny_model import ensure_tiny_model

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.affinity.sdk_balancing", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", help="output folder (default benchmarks/results/<timestamp>-affinity)")
    parser.add_argument("--conversations", type=int, default=AffinityPlan.conversations)
    args = parser.parse_args(argv)
    out = args.out or os.path.join(RESULTS, f"{time.strftime('%Y%m%d-%H%M%S')}-affinity")
    os.makedirs(out, exist_ok=True)
    started = time.monotonic()
    log = lambda msg: print(f"[affinity {time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    model_dir = str(ensure_tiny_model(os.path.join(RESULTS, ".model", "qwen2_vl"), replace_stale=True))
    plan = AffinityPlan(conversations=args.conversations)
    result = run(model_dir, Images(os.path.join(RESULTS, ".images"), plan.size), plan, log)
    result["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    table = markdown(result)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("# mmcast benchmark — affinity\n\n" + table + "\n")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(table)
    return 0 if result["tokens_equal"] and not any(r["failed"] for r in result["policies"]) else 1


if __name__ == "__main__":
    from common.process import ensure_allocator_env

    ensure_allocator_env()
    raise SystemExit(main())
