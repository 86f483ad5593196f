"""Real ``mmcast-worker`` rank processes started from the CLI, as a group (the worker process and fault tests use it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.worker_driver import (
    StreamClient,
    handshake,
    next_epoch,
    rank_token_file,
)

WORKER_BIN = os.path.join(os.path.dirname(sys.executable), "mmcast-worker")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """N rank processes started from the CLI; rank 1 takes its settings from MMCAST_* variables."""

    def __init__(self, model_dir, log_dir, world_size=2, timeout_s=5.0) -> None:
        self.model_dir = model_dir
        self.ports = [free_port() for _ in range(world_size)]
        self.metrics_ports = [free_port() for _ in range(world_size)]
        dist = f"tcp://127.0.0.1:{free_port()}"
        self.logs = [log_dir / f"rank{r}.log" for r in range(world_size)]
        self.procs = []
        for rank in range(world_size):
            settings = {
                "rank": rank,
                "world-size": world_size,
                "listen": f"127.0.0.1:{self.ports[rank]}",
                "dist-init": dist,
                "model": model_dir,
                "kv-blocks": 128,
                "metrics-port": self.metrics_ports[rank],
                "group-timeout-seconds": timeout_s,
                "scheduler-id": "test",
                "shared-token-file": rank_token_file(),
            }
            env = dict(os.environ)
            if rank == 1:  # the Kubernetes way: environment variables only
                env.update({"MMCAST_" + k.upper().replace("-", "_"): str(v) for k, v in settings.items()})
                args = [WORKER_BIN]
            else:
                args = [WORKER_BIN] + [x for k, v in settings.items() for x in (f"--{k}", str(v))]
            self.procs.append(
                subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=self.logs[rank].open("w"))
            )
        deadline = time.monotonic() + 60
        for rank, port in enumerate(self.ports):
            self._wait_ready(rank, port, deadline)

    def _wait_ready(self, rank, port, deadline) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.procs[rank].poll() is not None:
                    raise RuntimeError(f"rank {rank} exited: {self.logs[rank].read_text()[-2000:]}")
                try:
                    request = health_pb2.HealthCheckRequest(service="mmcast.v1.WorkerService")
                    if stub.Check(request, timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"rank {rank} not ready: {self.logs[rank].read_text()[-2000:]}")

    def streams(self, epoch=None):
        """One stream per rank under one epoch, as the scheduler opens them (the ranks' step vote compares it)."""
        epoch = next_epoch() if epoch is None else epoch
        return [
            StreamClient(
                f"127.0.0.1:{port}", handshake(self.model_dir, rank=r, world_size=len(self.ports), epoch=epoch)
            )
            for r, port in enumerate(self.ports)
        ]

    def received(self, rank) -> dict:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[rank]}/metrics", timeout=5).read().decode()
        out = {}
        for line in text.splitlines():
            if line.startswith("mmcast_worker_received_bytes_total{"):
                kind = line.split('kind="')[1].split('"')[0]
                out[kind] = int(float(line.rsplit(" ", 1)[1]))
        return out

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
