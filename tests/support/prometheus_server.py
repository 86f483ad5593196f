"""A throwaway Prometheus (the Debian `prometheus` binary) on loopback, for tests that scrape live mmcast processes,
and a small client of the Prometheus HTTP API (`PrometheusAPI`) for any Prometheus.

    with PrometheusServer({"mmcast-scheduler": [url], "mmcast-worker": [url0, url1]}, tmp_path) as prom:
        prom.wait_targets_up(3, timeout=60)
        prom.query("sum(rate(mmcast_broadcast_bytes_total[5m]))")         # -> [{"metric": {...}, "value": [t, "v"]}]
        prom.query_range(expr, start, end, step=1.0)                      # -> [{"metric": {...}, "values": [...]}]

The server gets its own temporary TSDB, a generated config (one job per entry, `scrape_interval` 1 s by default) and
a free port; it runs in its own process group and is stopped (SIGTERM, then SIGKILL) on exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from mmcast_local.child_processes import free_ports
from tests.support.deploy_tools import tool


class PrometheusError(RuntimeError):
    pass


def scrape_config(
    jobs: Mapping[str, Sequence[str]], *, scrape_interval: float = 1.0, rule_files: Sequence[Path] = ()
) -> dict:
    """A prometheus.yml scraping each job's `http://host:port/path` URLs (one path per job)."""
    interval = f"{int(scrape_interval * 1000)}ms"
    configs = []
    for job, urls in jobs.items():
        parsed = [urllib.parse.urlsplit(u) for u in urls]
        paths = {p.path or "/metrics" for p in parsed}
        if len(paths) != 1:
            raise ValueError(f"job {job}: every target must share one metrics path, got {sorted(paths)}")
        configs.append(
            {
                "job_name": job,
                "metrics_path": paths.pop(),
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "static_configs": [{"targets": [p.netloc for p in parsed]}],
            }
        )
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(f) for f in rule_files],
        "scrape_configs": configs,
    }


class PrometheusAPI:
    """The parts of the HTTP API (/api/v1) the tests and the dashboard renderer use."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def api(self, path: str, **params: object) -> dict:
        """GET /api/v1/<path>; the `data` of a success, else PrometheusError with Prometheus' error text."""
        url = f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as e:
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        """Instant vector result of `expr` (evaluated now, or at unix time `at`)."""
        data = self.api("query", query=expr, **({"time": f"{at:.3f}"} if at is not None else {}))
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr}: expected an instant vector, got {data['resultType']}")
        return data["result"]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict]:
        """Matrix result: one {"metric", "values": [[t, "v"], ...]} per series."""
        data = self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step=f"{step}")
        return data["result"]

    def targets(self) -> list[dict]:
        return self.api("targets", state="active")["activeTargets"]


class PrometheusServer(PrometheusAPI):
    def __init__(
        self,
        jobs: Mapping[str, Sequence[str]],
        workdir: Path,
        *,
        scrape_interval: float = 1.0,
        rule_files: Sequence[Path] = (),
        host: str = "127.0.0.1",
    ) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.scrape_interval = scrape_interval
        self.config_file = self.workdir / "prometheus.yml"
        self.config_file.write_text(
            yaml.safe_dump(scrape_config(jobs, scrape_interval=scrape_interval, rule_files=rule_files))
        )
        self.log_file = self.workdir / "prometheus.log"
        (self.port,) = free_ports(1, host)
        super().__init__(f"http://{host}:{self.port}")
        self.process: subprocess.Popen | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> PrometheusServer:
        args = [
            tool("prometheus"),
            f"--config.file={self.config_file}",
            f"--storage.tsdb.path={self.workdir / 'tsdb'}",
            f"--web.listen-address={self.url.removeprefix('http://')}",
            "--storage.tsdb.retention.time=1h",
            "--log.level=warn",
        ]
        with open(self.log_file, "ab") as log:
            self.process = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, process_group=0
            )
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return
            if time.monotonic() > deadline:
                raise PrometheusError(f"Prometheus at {self.url} not ready after {timeout:.0f} s\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        p, self.process = self.process, None
        if p is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(5)

    def __enter__(self) -> PrometheusServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_file.read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            return ""
        return f"--- {self.log_file} (last {len(text)} lines)\n" + "\n".join(text)

    def _check_alive(self) -> None:
        if self.process is None or self.process.poll() is not None:
            code = None if self.process is None else self.process.returncode
            raise PrometheusError(f"Prometheus is not running (exit {code})\n{self.log_tail()}")

    # -- waiting on scrapes -----------------------------------------------------------------------------------------
    def wait_targets_up(self, count: int, timeout: float = 60.0) -> None:
        """Until `count` targets have been scraped successfully (`up == 1`); a new target takes a few seconds."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            up = [s for s in self.query("up") if s["value"][1] == "1"]
            if len(up) >= count:
                return
            if time.monotonic() > deadline:
                states = [(t["scrapeUrl"], t["health"], t.get("lastError", "")) for t in self.targets()]
                raise PrometheusError(f"{len(up)}/{count} targets up after {timeout:.0f} s: {states}")
            time.sleep(0.2)

    def wait_scraped_after(self, unix_time: float, count: int, timeout: float = 30.0) -> None:
        """Until each of `count` targets has a successful scrape that started after `unix_time`."""
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            fresh = [s for s in self.query("timestamp(up) and up == 1") if float(s["value"][1]) > unix_time]
            if len(fresh) >= count:
                return
            if time.monotonic() > deadline:
                raise PrometheusError(f"only {len(fresh)}/{count} targets scraped after {unix_time} within {timeout} s")
            time.sleep(0.2)
