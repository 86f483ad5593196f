"""Helpers of the security tests: secrets on disk, /metrics scraping, a standalone rank process, readiness polling
over plaintext or TLS."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from mmcast_local.child_processes import free_ports

WORKER_BIN = os.path.join(os.path.dirname(sys.executable), "mmcast-worker")


def new_token() -> str:
    return secrets.token_urlsafe(24)


def secret_file(path: Path, content: str) -> Path:
    path.write_text(content)
    path.chmod(0o600)
    return path


def scrape(url: str) -> dict[str, float]:
    """Every sample of a /metrics page: ``name{label="v",...}`` (labels sorted) -> value."""
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Polls ``condition()`` until it returns a truthy value; fails naming ``what`` (and the last value)."""
    deadline = time.monotonic() + timeout
    value = condition()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (still {value!r} after {timeout:.0f} s)")
        time.sleep(interval)
        value = condition()
    return value


def serving(
    target: str, service: str, credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None
) -> bool:
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    channel = (
        grpc.secure_channel(target, credentials, options=options)
        if credentials is not None
        else grpc.insecure_channel(target)
    )
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False
    finally:
        channel.close()


class WorkerProcess:
    """A standalone ``mmcast-worker`` (world size 1) on loopback, started from the CLI."""

    def __init__(self, model_dir, log_path: Path, args: list[str]) -> None:
        self.port, self.metrics_port = free_ports(2)
        self.target = f"127.0.0.1:{self.port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.log_path = log_path
        argv = [
            WORKER_BIN,
            "--model",
            str(model_dir),
            "--listen",
            self.target,
            "--metrics-port",
            str(self.metrics_port),
            *args,
        ]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=log_path.open("wb"))

    def wait_ready(self, timeout: float = 120.0, credentials=None) -> None:
        def ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"the rank exited ({self.process.returncode}): {self.log_tail()}")
            return serving(self.target, "mmcast.v1.WorkerService", credentials)

        wait_for(ready, timeout, f"rank at {self.target} not SERVING:\n{self.log_tail()}", interval=0.1)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
