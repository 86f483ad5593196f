"""Load against a real local deployment (LocalGroup: scheduler + TP=2 worker processes), every answer checked
against the transformers oracle, every process's RSS sampled against a bound derived from its flags.

``tests/faults/test_e2e.py`` runs a short load on its group in ``make test``; ``tests/faults/test_soak.py`` runs the
long one in ``make soak``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import signal
import threading
import time

from mmcast_client import Client
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.oracle import Oracle, mismatch, user_turn

MiB = 1 << 20


BASE_SIZE = (112, 112)  # 8 x 8 patches, 16 image tokens: real processing at oracle-friendly cost


FRESH_SIZES = ((84, 112), (112, 84), (140, 112), (56, 56))


TEXTS = ("Describe the picture.", "Which colours stand out?", "Compare these pictures.")


# Headroom above the cache budgets: glibc keeps MALLOC_TOP_PAD_ (64 MiB) and never trims (common/process.py), a
# step's activations and gRPC buffers come and go. Measured peaks stay well below it (docs/RELIABILITY.md).
RSS_SLACK = 256 * MiB


# -- the workload ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Prompt:
    key: str
    messages: list
    fresh: bool  # its image is sent exactly once in the whole run (uncached when it arrives)


class Workload:
    """A fixed set of prompts with their oracle answers, computed before the load starts.

    Shared prompts use a few base images, alone with different texts, in pairs and twice in one prompt: repeated
    they hit the prefix cache; with another text or partner their images are already held by the ranks. Fresh
    prompts each carry an image of its own and are handed out once: uncached when they arrive.
    """

    def __init__(self, oracle: Oracle, *, seed: int, n_base: int, n_fresh: int, max_tokens: int) -> None:
        base = [synthetic_jpeg(seed * 1000 + i, BASE_SIZE) for i in range(n_base)]
        shared = []
        for i, img in enumerate(base):
            for t, text in enumerate(TEXTS[:2]):
                shared.append(Prompt(f"s{seed}-b{i}-t{t}", [user_turn(img, text)], False))
            pair = [{"type": "image", "image": img}, {"type": "image", "image": base[(i + 1) % n_base]}]
            shared.append(
                Prompt(
                    f"s{seed}-p{i}", [{"role": "user", "content": [*pair, {"type": "text", "text": TEXTS[2]}]}], False
                )
            )
        twice = [{"type": "image", "image": base[0]}, {"type": "image", "image": base[0]}]
        shared.append(
            Prompt(f"s{seed}-twice", [{"role": "user", "content": [*twice, {"type": "text", "text": TEXTS[2]}]}], False)
        )
        fresh = [
            Prompt(
                f"s{seed}-f{k}",
                [user_turn(synthetic_jpeg(seed * 1000 + 500 + k, FRESH_SIZES[k % len(FRESH_SIZES)]), TEXTS[k % 2])],
                True,
            )
            for k in range(n_fresh)
        ]
        self.max_tokens = max_tokens
        self.shared = shared
        self._fresh = collections.deque(fresh)
        self._lock = threading.Lock()
        self.expected = {p.key: oracle(p.messages, max_tokens) for p in shared + fresh}

    def pick(self, rng: random.Random, p_fresh: float) -> Prompt:
        if rng.random() < p_fresh:
            with self._lock:
                if self._fresh:
                    return self._fresh.popleft()
        return rng.choice(self.shared)


# -- RSS ------------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Budgets:
    """The memory-relevant flags of a deployment and the model dimensions that turn them into bytes."""

    processor_cache_bytes: int  # scheduler --processor-cache-bytes
    upload_store_bytes: int  # scheduler --upload-store-bytes
    kv_blocks: int  # worker --kv-blocks
    payload_cache_bytes: int  # worker --payload-cache-bytes
    encoder_cache_tokens: int  # worker --encoder-cache-tokens

    def scheduler_args(self) -> list[str]:
        return [
            "--processor-cache-bytes",
            str(self.processor_cache_bytes),
            "--upload-store-bytes",
            str(self.upload_store_bytes),
        ]

    def worker_args(self) -> list[str]:
        return [
            "--payload-cache-bytes",
            str(self.payload_cache_bytes),
            "--encoder-cache-tokens",
            str(self.encoder_cache_tokens),
        ]

    def bounds(self, baseline: dict[str, int], model_config, tp: int, block_size: int = 16) -> dict[str, int]:
        """Per process: its RSS when ready + what its caches may hold + RSS_SLACK. A rank's KV pool is allocated
        zeroed at start and faults in as blocks are written, so it counts here too."""
        text = model_config.get_text_config(decoder=True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_pool = (
            text.num_hidden_layers * 2 * (text.num_key_value_heads // tp) * self.kv_blocks * block_size * head_dim * 4
        )
        encoder = self.encoder_cache_tokens * text.hidden_size * 4
        worker = kv_pool + self.payload_cache_bytes + encoder
        scheduler = self.processor_cache_bytes + self.upload_store_bytes
        return {
            name: rss + (scheduler if name == "scheduler" else worker) + RSS_SLACK for name, rss in baseline.items()
        }


def rss_of(group: LocalGroup) -> dict[str, int]:
    import psutil

    out = {}
    for name, pid in group.pids().items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss
        except (psutil.NoSuchProcess, TypeError):
            pass
    return out


class RssSampler:
    """Samples every process's RSS until stopped; keeps each name's peak and the (time, rss) series."""

    def __init__(self, group: LocalGroup, interval: float = 0.5) -> None:
        self.group = group
        self.interval = interval
        self.peak: dict[str, int] = {}
        self.series: dict[str, list[tuple[float, int]]] = collections.defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._t0 = time.monotonic()

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic() - self._t0
            for name, rss in rss_of(self.group).items():
                self.peak[name] = max(self.peak.get(name, 0), rss)
                self.series[name].append((now, rss))
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# -- the load -------------------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclasses.dataclass
class LoadReport:
    clients: int
    seconds: float  # wall time from the first request to the last answer
    requests: int = 0
    tokens: int = 0
    errors: list[str] = dataclasses.field(default_factory=list)
    mismatches: list[str] = dataclasses.field(default_factory=list)
    ttft: list[float] = dataclasses.field(default_factory=list)  # client side: generate() -> first token
    server_ttft: list[float] = dataclasses.field(default_factory=list)  # server side: received -> first token sent
    prefix_hits: int = 0  # requests with cached_tokens > 0
    rank_cached: int = 0  # requests with an image the ranks already held
    stripped: int = 0  # requests with an image the prefix cache covered (payload never sent)
    salted: int = 0  # requests with a random cache salt (no prefix hit)
    sent: int = 0  # requests with an image whose payload was sent
    fresh: int = 0  # requests of a fresh (uncached) image
    inline: int = 0  # requests from clients that resend image bytes (upload_images=False)
    preemptions: int = 0  # sum of usage.preemptions (preemptions and recoveries)
    rss_peak: dict[str, int] = dataclasses.field(default_factory=dict)
    rss_bound: dict[str, int] = dataclasses.field(default_factory=dict)
    rss_baseline: dict[str, int] = dataclasses.field(default_factory=dict)
    rss_series: dict[str, list[tuple[float, int]]] = dataclasses.field(default_factory=dict)  # (seconds, bytes)
    kills: int = 0  # worker ranks killed during the run

    def summary(self) -> dict:
        return {
            "clients": self.clients,
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "tokens": self.tokens,
            "errors": len(self.errors),
            "mismatches": len(self.mismatches),
            "requests_per_second": round(self.requests / self.seconds, 2),
            "tokens_per_second": round(self.tokens / self.seconds, 1),
            "ttft_p50_ms": round(percentile(self.ttft, 50) * 1000, 1),
            "ttft_p99_ms": round(percentile(self.ttft, 99) * 1000, 1),
            "server_ttft_p50_ms": round(percentile(self.server_ttft, 50) * 1000, 1),
            "server_ttft_p99_ms": round(percentile(self.server_ttft, 99) * 1000, 1),
            "requests_with_prefix_hit": self.prefix_hits,
            "requests_with_rank_cached_image": self.rank_cached,
            "requests_with_prefix_covered_image": self.stripped,
            "salted_requests": self.salted,
            "requests_with_sent_image": self.sent,
            "fresh_image_requests": self.fresh,
            "inline_bytes_requests": self.inline,
            "preemptions_and_recoveries": self.preemptions,
            "rank_kills": self.kills,
            "rss_baseline_mib": {k: round(v / MiB, 1) for k, v in sorted(self.rss_baseline.items())},
            "rss_peak_mib": {k: round(v / MiB, 1) for k, v in sorted(self.rss_peak.items())},
            "rss_bound_mib": {k: round(v / MiB, 1) for k, v in sorted(self.rss_bound.items())},
            "rss_second_half_growth_mib": self.second_half_growth(),
        }

    def second_half_growth(self) -> dict[str, float]:
        """Per process: its peak RSS over the second half of the run minus its peak over the first half (a leak
        keeps growing; caches that fill up stop). Negative for a rank restarted in between."""
        out = {}
        for name, series in sorted(self.rss_series.items()):
            half = self.seconds / 2
            first = [rss for t, rss in series if t < half]
            second = [rss for t, rss in series if t >= half]
            if first and second:
                out[name] = round((max(second) - max(first)) / MiB, 1)
        return out


def run_load(
    group: LocalGroup,
    workload: Workload,
    *,
    clients: int,
    seconds: float,
    rss_bound: dict[str, int],
    rss_baseline: dict[str, int],
    p_fresh: float = 0.15,
    p_salt: float = 0.2,
    seed: int = 0,
    kill_every: float = 0.0,
    request_timeout: float = 300.0,
) -> LoadReport:
    """``clients`` threads, each with its own Client (even: upload by hash, the SDK default; odd: bytes inline),
    send greedy ``ignore_eos`` requests back to back for ``seconds``; every answer is compared with the oracle's.
    A share ``p_salt`` of requests carries a random cache salt: no prefix hit, so their images, already held by
    the ranks, are used from the ranks' caches. With ``kill_every`` > 0 a worker rank is killed (SIGKILL,
    alternating ranks) that often."""
    report = LoadReport(clients=clients, seconds=0.0, rss_bound=rss_bound, rss_baseline=rss_baseline)
    lock = threading.Lock()
    start = threading.Barrier(clients + 1)
    end_at: list[float] = []

    def client(index: int) -> None:
        rng = random.Random(seed * 10_000 + index)
        inline = index % 2 == 1
        with Client(group.target, timeout=request_timeout, upload_images=not inline) as c:
            start.wait()
            while time.monotonic() < end_at[0]:
                prompt = workload.pick(rng, p_fresh)
                salt = f"salt-{rng.getrandbits(64):x}" if rng.random() < p_salt else None
                try:
                    result = c.generate(
                        prompt.messages,
                        max_tokens=workload.max_tokens,
                        ignore_eos=True,
                        logprobs=0,
                        cache_salt=salt,
                    )
                except Exception as exc:  # noqa: BLE001 - counted; the test requires none
                    with lock:
                        report.errors.append(f"client {index} {prompt.key}: {type(exc).__name__}: {exc}")
                    continue
                problem = mismatch(result, workload.expected[prompt.key])
                u = result.usage
                with lock:
                    report.requests += 1
                    report.tokens += len(result.token_ids)
                    report.ttft.append(result.ttft_seconds)
                    report.server_ttft.append(result.server_ttft_seconds)
                    report.prefix_hits += u.cached_tokens > 0
                    report.rank_cached += u.images_rank_cached > 0
                    report.stripped += u.images_stripped > 0
                    report.salted += salt is not None
                    report.sent += u.images_sent > 0
                    report.fresh += prompt.fresh
                    report.inline += inline
                    report.preemptions += u.preemptions
                    if problem:
                        report.mismatches.append(f"client {index} {prompt.key}: {problem}")

    threads = [threading.Thread(target=client, args=(i,), name=f"load-client-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    with RssSampler(group) as sampler:
        t0 = time.monotonic()
        end_at.append(t0 + seconds)
        start.wait()
        next_kill, rank = (t0 + kill_every, 1) if kill_every else (float("inf"), 1)
        while any(t.is_alive() for t in threads):
            if time.monotonic() >= next_kill and time.monotonic() < end_at[0]:
                group.kill_rank(rank, signal.SIGKILL)
                report.kills += 1
                rank = 1 - rank
                next_kill += kill_every
            time.sleep(0.2)
        report.seconds = time.monotonic() - t0
    report.rss_peak = dict(sampler.peak)
    report.rss_series = dict(sampler.series)
    return report


def check_load(report: LoadReport) -> None:
    """What every load run must show: zero errors, every answer equal to the oracle, RSS within its bound, and a
    workload that really mixed prefix-covered, rank-cached and sent images, fresh images and both client kinds."""
    assert report.errors == [], report.errors[:5]
    assert report.mismatches == [], report.mismatches[:5]
    over = {
        k: (report.rss_peak[k] // MiB, b // MiB) for k, b in report.rss_bound.items() if report.rss_peak.get(k, 0) > b
    }
    assert not over, f"RSS above its bound (MiB peak, bound): {over}"
    assert report.requests > 0 and report.prefix_hits > 0 and report.stripped > 0
    assert report.rank_cached > 0 and report.sent > 0
    assert report.fresh > 0 and 0 < report.inline < report.requests


def write_report(name: str, report: LoadReport, extra: dict | None = None) -> dict:
    summary = {"name": name, **report.summary(), **(extra or {})}
    print(f"\nLOAD {json.dumps(summary, sort_keys=True)}")
    path = os.environ.get("MMCAST_SOAK_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(summary, sort_keys=True) + "\n")
    return summary
