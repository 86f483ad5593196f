"""A real Prometheus scraping a live local group: every dashboard expression and recording rule has real data.

One module-scoped run: a TP=2 lazy group (LocalGroup, the code behind `mmcast serve-local`) with a small KV pool, a
Prometheus on loopback scraping the scheduler and both ranks every second (and loading the chart's rules), then a
workload through the SDK chosen so that every panel has something to show:
- a growing three-turn conversation: prefix hits, stripped items (saved bytes: prefix_covered);
- six concurrent requests re-using its images behind other text: rank-cached items (saved bytes: rank_cached),
  encoder-cache hits and, with 56 KV blocks, a waiting queue and preemptions. Their text comes first, so they share
  only the system prompt's block with each other and the conversation: three fit at admission (3 x 18 blocks) and
  must grow past the pool (3 x 24 blocks), the other three wait; a barrier releases the six together, so they
  overlap however loaded the machine is. The round repeats until a scrape has seen the queue and the full pool;
- one prompt larger than the KV pool: RESOURCE_EXHAUSTED, a server-side gRPC error for the error-ratio panel;
- GetServerInfo: a unary RPC for the unary-latency panel.
The same run checks that every metric added with the per-request histograms has data that adds up (their sums
equal the older counters), and that the scheduler's `request finished` log lines carry what each client received.
With MMCAST_RENDER_DASHBOARD=1 the run also renders docs/img/dashboard.png (tests/support/render_dashboard.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from mmcast_client import Client, ResourceExhausted
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.dashboard import panels, substitute_variables
from tests.support.deploy_tools import ROOT, RULES_FILE, tool
from tests.support.prometheus_server import PrometheusServer

pytestmark = pytest.mark.slow

TP = 2
KV_BLOCKS = 56  # the conversation's last turn needs 47 blocks; see the module docstring for the concurrent ones
IMAGE_SIZE = (448, 336)  # 192 image tokens each
QUESTIONS = (
    "Look carefully at this landscape and describe the sky, the hills, the colours and anything unusual in it.",
    "Compare this new picture with the previous one: which has more clouds, where is the sun, what changed?",
    "Now consider all of the pictures so far together and tell me which one feels the warmest and why.",
)
CONCURRENT_REQUESTS = 6  # three run while three wait, so the queue lasts about half of a round
CONCURRENT_MAX_TOKENS = 96
QUEUE_ROUNDS = 15  # rounds of the concurrent requests at most, until a scrape has seen the queue and a full pool
KV_FULL_SEEN = 0.5  # KV usage a scrape must have seen during the concurrent rounds (three requests need 54 of 56)
RENDER_ENV = "MMCAST_RENDER_DASHBOARD"
PICTURE = ROOT / "docs" / "img" / "dashboard.png"

# Expressions whose series legitimately stay at 0 in this run, with the reason. Every other expression must show a
# value above 0 at some point of the run.
ZERO_ALLOWED = {
    ("Worker protocol errors/s by code", "A"): (
        "a protocol error needs a malformed step frame from the scheduler, which no SDK request can cause, and the "
        "refusal makes the scheduler recover the whole group; the series are the counter's pre-created codes at 0 "
        "(tests/worker/test_protocol.py checks the counting)"
    ),
    ("HTTP API latency p99 by route", "B"): (
        "requests in flight show only in a scrape taken during an HTTP request, and the workload's few last "
        "milliseconds; the gauge's rise and fall is checked in test_new_series_have_data_that_adds_up"
    ),
}
# Series the workload is built to move, by panel and refId: each must rise above 0 during the run.
MUST_RISE = {
    ("Broadcast bytes/s by kind", "A"): [{"kind": "payload"}, {"kind": "metadata"}, {"kind": "control"}],
    ("Payload bytes saved/s by reason", "A"): [{"reason": "prefix_covered"}, {"reason": "rank_cached"}],
    ("Multimodal items/s by disposition", "A"): [{"disposition": d} for d in ("sent", "stripped", "rank_cached")],
    ("gRPC error ratio by method", "A"): [{"grpc_service": "mmcast.v1.GenerationService", "grpc_method": "Generate"}],
    ("Worker cache hit ratio", "A"): [{"cache": "encoder"}],
    ("Requests finished/s by reason", "A"): [{"reason": "length"}],
    ("gRPC unary latency p99 by method", "A"): [{"grpc_method": "GetServerInfo"}],
    ("Worker received bytes/s by kind", "A"): [{"kind": "payload"}, {"kind": "metadata"}, {"kind": "control"}],
    ("HTTP API requests/s by route and status", "A"): [{"route": "/v1/chat/completions", "status": "200"}],
}
# Series added with the per-request metrics (CHANGELOG.md, "Metrics"): each must have data from this run.
NEW_HISTOGRAMS = (
    "mmcast_e2e_request_latency_seconds",
    "mmcast_request_queue_time_seconds",
    "mmcast_inter_token_latency_seconds",
    "mmcast_request_prompt_tokens",
    "mmcast_request_generation_tokens",
    "mmcast_worker_encoder_seconds",
)
# promtool lints that a service still has, each with what removes it; anything else fails the check.
KNOWN_METRIC_LINTS: dict[str, str] = {}


def user_turn(image: bytes, text: str, text_first: bool = False) -> dict:
    content = [{"type": "image", "image": image}, {"type": "text", "text": text}]
    return {"role": "user", "content": content[::-1] if text_first else content}


class LiveRun:
    """What the workload left behind: the group, the Prometheus and the run's time range."""

    def __init__(self, group: LocalGroup, prom: PrometheusServer) -> None:
        self.group, self.prom = group, prom
        self.start = self.end = 0.0  # unix times: every target scraped once / the workload done
        self.preemptions = 0
        self.results: list = []  # every Result the workload received through the SDK
        self.http_completions: list[int] = []  # completion tokens of each answered HTTP API request
        self.http_usage: dict[str, dict] = {}  # x-request-id -> usage of the answered non-streaming HTTP requests

    def checkpoint(self) -> None:
        """Waits for a successful scrape of every target, so that what happened before it and what happens after
        fall into different samples: rate() sees each phase's increments even if some scrapes time out."""
        self.prom.wait_scraped_after(time.time(), 1 + TP, timeout=30)

    def workload(self) -> None:
        images = [synthetic_jpeg(2000 + i, IMAGE_SIZE) for i in range(3)]
        with Client(self.group.target, timeout=120) as client:
            # The first call of a method creates its series (every code at 0): scraped before the next calls.
            assert client.get_server_info().group_ready
            self.checkpoint()
            history: list[dict] = []
            for turn in range(3):
                history.append(user_turn(images[turn], QUESTIONS[turn]))
                result = client.generate(history, max_tokens=8, ignore_eos=True)
                self.results.append(result)
                history.append({"role": "assistant", "content": result.text})
            assert result.usage.cached_tokens > 0 and result.usage.images_stripped > 0, result.usage
            self.checkpoint()

            # A scrape sees the waiting queue and the full KV pool only if one falls while they last, which on a
            # fast machine may be less than the 1 s scrape interval: the round repeats (at most QUEUE_ROUNDS times)
            # until Prometheus has sampled both, so the "Requests running / waiting" and KV panels are checked on
            # real data.
            usages: list = []
            seen_waiting = seen_full = False
            for _ in range(QUEUE_ROUNDS):
                round_start = time.time()
                usages += self.concurrent_round(client, images)
                self.checkpoint()
                waiting = self.prom.query_range("sum(mmcast_requests_waiting)", round_start, time.time(), step=0.25)
                kv = self.prom.query_range("max(mmcast_kv_cache_usage_ratio)", round_start, time.time(), step=0.25)
                seen_waiting = seen_waiting or _rises(waiting)
                seen_full = seen_full or any(v > KV_FULL_SEEN for v in _values(kv))
                if seen_waiting and seen_full:
                    break
            missed = [
                what for what, seen in (("a waiting queue", seen_waiting), ("a full KV pool", seen_full)) if not seen
            ]
            assert not missed, f"no scrape saw {' or '.join(missed)} in {QUEUE_ROUNDS} rounds"
            self.preemptions = sum(u.preemptions for u in usages)
            assert self.preemptions > 0, f"no preemption with --kv-blocks {KV_BLOCKS}: {usages}"
            assert sum(u.images_rank_cached for u in usages) > 0, usages

            with pytest.raises(ResourceExhausted):
                client.generate("word " * (KV_BLOCKS * 16), max_tokens=8)
            client.get_server_info()
        self.http_workload(images[0])

    def concurrent_round(self, client: Client, images: list[bytes]) -> list:
        """CONCURRENT_REQUESTS requests released together, more than the KV pool holds: a queue and preemptions."""
        usages, errors = [], []
        start_together = threading.Barrier(CONCURRENT_REQUESTS)

        def other_view(k: int) -> None:
            try:
                text = f"Seen from another place ({k}): " + QUESTIONS[k % 3]
                messages = [user_turn(images[k % 3], text, text_first=True)]
                start_together.wait(timeout=60)
                r = client.generate(messages, max_tokens=CONCURRENT_MAX_TOKENS, ignore_eos=True)
                usages.append(r.usage)
                self.results.append(r)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=other_view, args=(k,)) for k in range(CONCURRENT_REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        return usages

    def http_workload(self, image: bytes) -> None:
        """The OpenAI-compatible API: a first request creates its series, scraped before the ones that move them."""
        import base64

        import httpx

        url = self.group.openai_base_url + "/chat/completions"
        part = {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(image).decode()}}
        body = {
            "model": Path(self.group.model_dir).name,
            "max_tokens": 4,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": [part, {"type": "text", "text": QUESTIONS[0]}]}],
        }
        with httpx.Client(timeout=120) as http:
            for stream in (False, False, True):
                r = http.post(url, json={**body, "stream": stream})
                assert r.status_code == 200, r.text
                self.http_completions.append(4)
                self.http_usage[r.headers["x-request-id"]] = {} if stream else r.json()["usage"]
                if len(self.http_completions) == 1:
                    self.checkpoint()
            assert http.post(url, json={**body, "n": 1000}).status_code == 400
        self.checkpoint()


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory) -> LiveRun:
    workdir = tmp_path_factory.mktemp("live-prometheus")
    with contextlib.ExitStack() as stack:
        group = LocalGroup(
            tiny_model_dir,
            tp=TP,
            transfer_mode="lazy",
            kv_blocks=KV_BLOCKS,
            ready_timeout=150,
            log_dir=workdir / "logs",
        )
        urls = group.metrics_urls
        jobs = {"mmcast-scheduler": [urls["scheduler"]], "mmcast-worker": [urls[f"rank{r}"] for r in range(TP)]}
        # Prometheus first: it is ready and retrying its targets while the ranks load the model.
        prom = stack.enter_context(PrometheusServer(jobs, workdir / "prometheus", rule_files=[RULES_FILE]))
        stack.enter_context(group)
        run_ = LiveRun(group, prom)
        prom.wait_targets_up(1 + TP, timeout=30)
        run_.start = time.time()
        run_.workload()
        run_.end = time.time()
        prom.wait_scraped_after(run_.end, 1 + TP, timeout=30)
        yield run_


def _values(result: list[dict]) -> list[float]:
    out = []
    for series in result:
        if "value" in series:
            out.append(float(series["value"][1]))
        else:
            out.extend(float(v) for _, v in series["values"])
    return out


def test_every_dashboard_expression_returns_real_series(live):
    problems = []
    now = time.time()  # after the fixture's last scrape
    step = 0.5  # below the scrape interval: every sample is the latest one at some point
    start = now - math.ceil((now - live.start) / step) * step  # so that `now` itself is the range's last point
    for panel in panels():
        for target in panel["targets"]:
            key = (panel["title"], target["refId"])
            expr = substitute_variables(target["expr"])
            assert "vector(" not in expr, f"{key}: no padding with constant vectors"
            instant = live.prom.query(expr, at=now)
            if not instant or not any(math.isfinite(v) for v in _values(instant)):
                problems.append(f"{key}: no finite series now: {instant}\n    {expr}")
                continue
            if key in ZERO_ALLOWED:
                continue
            over_run = live.prom.query_range(expr, start, now, step=step)
            if not _rises(over_run):
                problems.append(f"{key}: never above 0 during the run\n    {expr}")
            for labels in MUST_RISE.get(key, []):
                matching = [s for s in over_run if labels.items() <= s["metric"].items()]
                if not _rises(matching):
                    problems.append(f"{key}: the series {labels} never rose above 0: {matching}\n    {expr}")
    assert not problems, "\n".join(problems)


def _rises(result: list[dict]) -> bool:
    return any(math.isfinite(v) and v > 0 for v in _values(result))


def test_every_recording_rule_has_series_and_every_rule_is_healthy(live):
    groups = live.prom.api("rules")["groups"]
    rules = [r for g in groups for r in g["rules"]]
    source = yaml.safe_load(RULES_FILE.read_text())
    assert len(rules) == sum(len(g["rules"]) for g in source["groups"]), "Prometheus did not load every rule"
    deadline = time.monotonic() + 10
    while any(r.get("health") == "unknown" for r in rules) and time.monotonic() < deadline:
        time.sleep(0.5)  # a rule group evaluates every second; a rule not evaluated yet is "unknown"
        rules = [r for g in live.prom.api("rules")["groups"] for r in g["rules"]]
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r["health"], r.get("lastError")) for r in rules]
    for name in sorted({r["name"] for r in rules if r["type"] == "recording"}):
        values = _values(live.prom.query(name))
        assert any(math.isfinite(v) for v in values), f"recording rule {name} has no finite series"


@pytest.mark.parametrize("page", ["scheduler"] + [f"rank{r}" for r in range(TP)])
def test_metrics_page_passes_promtool_check_metrics(live, page):
    with urllib.request.urlopen(live.group.metrics_urls[page], timeout=10) as reply:
        text = reply.read().decode()
    assert "mmcast_" in text and "grpc_server_handled_total" in text
    proc = subprocess.run(
        [tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    lints = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    unexpected = [line for line in lints if line not in KNOWN_METRIC_LINTS]
    assert not unexpected, f"promtool check metrics on {page} (exit {proc.returncode}):\n" + "\n".join(lints)
    if not lints:
        assert proc.returncode == 0


def test_render_dashboard_picture(live):
    """Opt-in (MMCAST_RENDER_DASHBOARD=1): CI checks the data; the picture in docs/ is refreshed on purpose."""
    if os.environ.get(RENDER_ENV) != "1":
        pytest.skip(f"set {RENDER_ENV}=1 to render {PICTURE.relative_to(ROOT)}")
    from tests.support.render_dashboard import render_dashboard

    live.prom.wait_scraped_after(time.time() + 8, 1 + TP, timeout=20)  # let the rates fall back after the run
    out = Path(os.environ.get("MMCAST_DASHBOARD_PNG", PICTURE))
    title = (
        f"mmcast dashboard — live local group (TP={TP}, lazy, {KV_BLOCKS} KV blocks) scraped by Prometheus "
        "every 1 s; $__rate_interval=5s"
    )
    render_dashboard(live.prom, live.start - 2, time.time(), out, step=1.0, rate_interval="5s", title=title)
    assert out.stat().st_size > 10_000


def _scalar(prom, expr: str) -> float:
    (series,) = prom.query(expr)
    return float(series["value"][1])


def test_new_series_have_data_that_adds_up(live):
    """Every new series has samples from this run, and the per-request histograms agree with the older counters."""
    prom = live.prom
    for name in NEW_HISTOGRAMS:
        assert _scalar(prom, f"sum({name}_count)") > 0, f"{name}: no observation"
    requests = len(live.results) + len(live.http_completions)
    assert _scalar(prom, "sum(mmcast_e2e_request_latency_seconds_count)") == requests
    assert _scalar(prom, "sum(mmcast_request_queue_time_seconds_count)") == requests
    assert _scalar(prom, "sum(mmcast_request_generation_tokens_count)") == requests
    generated = _scalar(prom, "sum(mmcast_generation_tokens_total)")
    assert generated == sum(r.usage.completion_tokens for r in live.results) + sum(live.http_completions)
    assert _scalar(prom, "sum(mmcast_request_generation_tokens_sum)") == generated
    # Every request streamed tokens: one gap per token after each request's first.
    assert _scalar(prom, "sum(mmcast_inter_token_latency_seconds_count)") == generated - requests
    # The refused prompt was never admitted: the histogram holds the admitted prompts, like the counter.
    assert _scalar(prom, "sum(mmcast_request_prompt_tokens_sum)") == _scalar(prom, "sum(mmcast_prompt_tokens_total)")
    # The server's e2e histogram holds each request's total as its client got it (buckets bound them).
    # The HTTP API's answers: three served, one refused, none in flight now.
    assert _scalar(prom, 'sum(mmcast_http_requests_total{route="/v1/chat/completions", status="200"})') == 3
    assert _scalar(prom, 'sum(mmcast_http_requests_total{route="/v1/chat/completions", status="400"})') == 1
    assert _scalar(prom, "sum(mmcast_http_request_duration_seconds_count)") == 4
    assert _scalar(prom, "sum(mmcast_http_requests_in_flight)") == 0
    slowest = max(r.server_total_seconds for r in live.results)
    assert _scalar(prom, "sum(mmcast_e2e_request_latency_seconds_sum)") <= requests * slowest + 1e-6
    # KV usage: above 0 while the concurrent requests ran (the pool filled up to preemption), at most 1.
    usage = prom.query_range("max(mmcast_kv_cache_usage_ratio)", live.start, live.end, step=0.5)
    values = _values(usage)
    assert values and max(values) > KV_FULL_SEEN and max(values) <= 1, values
    # Ranks: both caches were looked up; encoder lookups hit (the concurrent requests re-use the images).
    for cache in ("payload", "encoder"):
        assert _scalar(prom, f'sum(mmcast_worker_cache_queries_total{{cache="{cache}"}})') > 0, cache
    hits = _scalar(prom, 'sum(mmcast_worker_cache_hits_total{cache="encoder"})')
    assert 0 < hits <= _scalar(prom, 'sum(mmcast_worker_cache_queries_total{cache="encoder"})')


def test_finished_request_log_lines_match_what_clients_received(live):
    """One `request finished` JSON line per request, with the numbers of the Usage and Timings its client got."""
    records = {}
    for line in (live.group.log_dir / "scheduler.log").read_text().splitlines():
        if not line.startswith("{"):
            continue
        record = json.loads(line)
        if record.get("msg") == "request finished":
            assert record["request_id"] not in records, f"two finished lines for {record['request_id']}"
            records[record["request_id"]] = record
    assert set(records) == {r.request_id for r in live.results} | set(live.http_usage)
    for request_id, usage in live.http_usage.items():  # the HTTP API's requests log the same line
        rec = records[request_id]
        assert rec["finish_reason"] == "length" and rec["completion_tokens"] == 4 and rec["images"] == 1
        if usage:
            assert rec["prompt_tokens"] == usage["prompt_tokens"]
            assert rec["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    for r in live.results:
        rec = records[r.request_id]
        assert rec["level"] == "info" and rec["component"] == "scheduler"
        assert rec["time"].endswith("Z") and len(rec["time"].rpartition(".")[2]) == 4, rec["time"]  # ".mmmZ"
        assert rec["finish_reason"] == r.finish_reason == "length"
        for key in (
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "images",
            "payload_bytes_broadcast",
            "payload_bytes_saved",
            "preemptions",
        ):
            assert rec[key] == getattr(r.usage, key), (key, rec, r.usage)
        assert rec["time_to_first_token_seconds"] == pytest.approx(r.server_ttft_seconds, abs=1e-5)
        assert rec["total_seconds"] == pytest.approx(r.server_total_seconds, abs=1e-5)
        assert rec["queue_seconds"] == pytest.approx(r.queue_seconds, abs=1e-5)
        assert 0 < rec["queue_seconds"] <= rec["time_to_first_token_seconds"] <= rec["total_seconds"]
        assert "tenant" not in rec  # authentication is off
    assert any(rec["cached_tokens"] > 0 and rec["payload_bytes_saved"] > 0 for rec in records.values())
    assert any(rec["preemptions"] > 0 for rec in records.values())
