"""Hostile and broken HTTP clients at the OpenAI door, on a real local deployment (one scheduler, one rank):
slowloris headers, thousands of idle connections, an SSE reader that stops reading, and a burst past the queue.

What must hold each time: the door keeps answering everyone else correctly (text and log-probabilities equal to
plain transformers), the bad connection is ended by the server within its bound (``--http-header-timeout-seconds``,
``--http-write-timeout-seconds``) with a clear status where one can still be sent, nothing stays running, the
scheduler's memory stays bounded, and the log names what was closed and why. Figures: ``NETFAULT {...}`` lines.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.parse

import httpx
import openai
import psutil
import pytest

from mmcast_local.supervisor import LocalGroup
from tests.support.net_traffic import report
from tests.support.oracle import LOGPROB_TOLERANCE, Oracle, scrape, wait_until

pytestmark = pytest.mark.slow

HEADER_TIMEOUT = 2.0  # --http-header-timeout-seconds
WRITE_TIMEOUT = 3.0  # --http-write-timeout-seconds
MAX_WAITING = 16  # --max-waiting: the queue a burst overflows
MAX_SEQS = 4  # --max-num-seqs
N_TOKENS = 8
EXTRA = {"ignore_eos": True}
RSS_GROWTH_BOUND = 96 << 20  # what a few thousand connections and one stalled stream may add to the scheduler


class Door:
    def __init__(self, group: LocalGroup, oracle: Oracle) -> None:
        self.group, self.oracle = group, oracle
        url = urllib.parse.urlsplit(group.openai_base_url)
        self.host, self.port = url.hostname, url.port
        self.tokenizer = oracle.processor.tokenizer
        self.model = group.model_dir.rstrip("/").rsplit("/", 1)[-1]

    def metric(self, name: str, **labels: str) -> float:
        return scrape(self.group.metrics_urls["scheduler"], name, **labels)

    def rss(self) -> int:
        return psutil.Process(self.group.pids()["scheduler"]).memory_info().rss

    def expected(self, prompt: str, n: int = N_TOKENS) -> tuple[str, list[float]]:
        ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        tokens, logprobs = self.oracle.generate({"input_ids": ids}, n)
        return self.tokenizer.decode(tokens, skip_special_tokens=True), logprobs

    def check_served(self, prompt: str = "The quick brown fox") -> None:
        """A well-behaved client is answered, equal to the oracle."""
        with openai.OpenAI(base_url=self.group.openai_base_url, api_key="x", max_retries=0, timeout=60) as api:
            out = api.completions.create(
                model=self.model, prompt=prompt, max_tokens=N_TOKENS, temperature=0.0, logprobs=0, extra_body=EXTRA
            )
        text, logprobs = self.expected(prompt)
        assert out.choices[0].text == text
        assert out.choices[0].logprobs.token_logprobs == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)

    def connect(self, small_window: bool = False) -> socket.socket:
        s = socket.socket()
        if small_window:  # a slow reader's socket: the server's kernel buffers stop growing at ~100 KB
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        s.connect((self.host, self.port))
        return s

    def log_records(self) -> list[dict]:
        lines = (self.group.log_dir / "scheduler.log").read_text(errors="replace").splitlines()
        return [json.loads(x) for x in lines if x.startswith("{")]


@pytest.fixture(scope="module")
def door(tiny_model_dir, tmp_path_factory):
    group = LocalGroup(
        tiny_model_dir,
        1,
        "lazy",
        log_dir=tmp_path_factory.mktemp("door-logs"),
        scheduler_args=[
            "--http-header-timeout-seconds",
            str(HEADER_TIMEOUT),
            "--http-write-timeout-seconds",
            str(WRITE_TIMEOUT),
            "--max-waiting",
            str(MAX_WAITING),
            "--max-num-seqs",
            str(MAX_SEQS),
        ],  # fmt: skip
        ready_timeout=180,
    )
    group.start()
    try:
        oracle = Oracle(tiny_model_dir)
        group.wait_ready()
        yield Door(group, oracle)
    finally:
        group.stop()


def read_until_closed(s: socket.socket, timeout: float) -> tuple[bytes, float | None]:
    """Everything the server sends until it closes (EOF or reset); the seconds it took, None if still open."""
    s.settimeout(0.2)
    data, t0 = b"", time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, time.monotonic() - t0
        if not chunk:
            return data, time.monotonic() - t0
        data += chunk
    return data, None


def test_slowloris_headers_are_cut_at_the_header_deadline(door):
    """20 clients trickle a header byte every 0.3 s, forever: each is answered 408 naming the flag and closed
    within the header deadline, while a normal client is served correctly meanwhile."""
    closed0 = door.metric("mmcast_http_connections_closed_total", reason="header_timeout")
    socks = [door.connect() for _ in range(20)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    stop = threading.Event()

    def trickle() -> None:
        while not stop.is_set():
            for s in socks:
                try:
                    s.send(b"X")
                except OSError:
                    pass
            time.sleep(0.3)

    t = threading.Thread(target=trickle, daemon=True)
    t0 = time.monotonic()
    t.start()
    try:
        door.check_served()
        answers = [read_until_closed(s, HEADER_TIMEOUT + 10) for s in socks]
    finally:
        stop.set()
        t.join()
        for s in socks:
            s.close()
    closed_after = [took for _, took in answers]
    assert all(took is not None for took in closed_after), "a slowloris connection was kept open"
    for data, _ in answers:
        assert data.startswith(b"HTTP/1.1 408"), data[:200]
        assert b"--http-header-timeout-seconds" in data, data[-300:]
    assert door.metric("mmcast_http_connections_closed_total", reason="header_timeout") - closed0 == 20
    report("http_slowloris", connections=20, closed_within_s=time.monotonic() - t0, status=408)


def test_two_thousand_idle_connections(door):
    """2,000 connections that never send a byte: the door keeps serving (correctly) while they are open, closes
    them all at the header deadline, and the scheduler's memory stays bounded."""
    rss0 = door.rss()
    closed0 = door.metric("mmcast_http_connections_closed_total", reason="header_timeout")
    socks = []
    t0 = time.monotonic()
    try:
        for _ in range(2000):
            socks.append(door.connect())
        opened = time.monotonic() - t0
        door.check_served()
        rss_open = door.rss()
        deadline = time.monotonic() + HEADER_TIMEOUT + 30
        closed = 0
        for s in socks:
            _, took = read_until_closed(s, max(0.1, deadline - time.monotonic()))
            closed += took is not None
        all_closed = time.monotonic() - t0
    finally:
        for s in socks:
            s.close()
    door.check_served()
    assert closed == 2000, f"{2000 - closed} idle connections still open after {HEADER_TIMEOUT + 30} s"
    assert rss_open - rss0 < RSS_GROWTH_BOUND, (rss0, rss_open)
    assert door.metric("mmcast_http_connections_closed_total", reason="header_timeout") - closed0 == 2000
    report(
        "http_idle_connections",
        connections=2000,
        opened_in_s=opened,
        all_closed_after_s=all_closed,
        rss_growth_mib=(rss_open - rss0) / 2**20,
    )


def test_an_sse_reader_that_stops_reading_is_ended(door):
    """A streaming client reads the first events, then stops reading (a 4 KiB receive window, 536-byte segments, so
    the client's kernel buffer holds ~100 KB; the server's send buffer may still grow to tcp_wmem's 4 MiB, so the stream
    is 8000 events of ~830 bytes, ~6.6 MB, more than both hold): the server stops
    writing into it once the socket is full, ends the connection after the write deadline instead of holding the
    stream (and the request) forever, the request is cancelled, and the scheduler's memory stays bounded."""
    rss0 = door.rss()
    closed0 = door.metric("mmcast_http_connections_closed_total", reason="write_timeout")
    body = json.dumps(
        {
            "model": door.model,
            "prompt": "Once upon a time",
            "max_tokens": 8000,
            "temperature": 0.0,
            "logprobs": 20,
            "stream": True,
            "ignore_eos": True,
        }
    ).encode()
    s = door.connect(small_window=True)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    s.settimeout(30)
    first = s.recv(4096)
    assert first.startswith(b"HTTP/1.1 200"), first[:200]
    t0 = time.monotonic()
    # Not reading: the server's writes stall once the socket buffers are full, and the write deadline ends the
    # connection. (The generation may finish first when the writer lags behind the ranks: the end is the closing.)
    stalled = lambda: door.metric("mmcast_http_connections_closed_total", reason="write_timeout") > closed0  # noqa: E731
    assert wait_until(stalled, 120, 0.2), "the stalled stream's connection was never closed for not reading"
    assert wait_until(lambda: door.metric("mmcast_requests_running") == 0, 30, 0.2), "the stalled stream never ended"
    ended = time.monotonic() - t0
    rss_peak = door.rss()
    data, took = read_until_closed(s, 30)
    s.close()
    assert took is not None, "the server kept the stalled stream's connection open"
    assert b"data: [DONE]" not in data, "the whole stream was buffered for a client that had stopped reading"
    assert rss_peak - rss0 < RSS_GROWTH_BOUND
    closed = [r for r in door.log_records() if "not reading" in r.get("msg", "")]
    assert closed, "no log line names the connection closed for not reading"
    door.check_served()
    report(
        "http_sse_reader_stops",
        request_ended_after_s=ended,
        bytes_read=len(first) + len(data),
        rss_growth_mib=(rss_peak - rss0) / 2**20,
    )


def test_a_burst_of_500_requests_gets_429_with_retry_after(door):
    """500 concurrent completions against a queue of 16: each is answered 200 (equal to the oracle) or 429 with
    Retry-After and an error naming --max-waiting; none hangs, none fails otherwise."""
    prompt = "A burst of requests"
    text, logprobs = door.expected(prompt)

    async def burst() -> list:
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=door.group.openai_base_url, timeout=120, limits=limits) as http:
            body = {"model": door.model, "prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0.0}
            body.update(logprobs=0, ignore_eos=True)
            return await asyncio.gather(*(http.post("/completions", json=body) for _ in range(500)))

    t0 = time.monotonic()
    answers = asyncio.run(burst())
    took = time.monotonic() - t0
    statuses: dict[int, int] = {}
    for r in answers:
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            assert choice["text"] == text
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
        else:
            assert r.status_code == 429, (r.status_code, r.text[:300])
            assert int(r.headers["Retry-After"]) >= 1
            assert "--max-waiting" in r.json()["error"]["message"]
    assert statuses.get(429, 0) > 0 and statuses.get(200, 0) >= MAX_WAITING, statuses
    assert wait_until(lambda: door.metric("mmcast_requests_running") == 0, 30)
    report(
        "http_burst_500", sent=500, completed=statuses.get(200, 0), failed={"429": statuses.get(429, 0)}, seconds=took
    )
