"""The group pod the chart renders (`topology: pod`) works as rendered: its containers, started as local processes
with the rendered commands, arguments and environment (one network namespace, as in a pod), form the group over
the loopback and serve a request. Only the model folder and the mounted token file are moved to local paths, and
the ports to free ones. Run it with `MMCAST_LIVE_CHART=1 .venv/bin/python -m pytest tests/deploy/test_deploy_group_pod_live.py`."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.deploy_tools import CI_VALUES, find, pod_spec, render

# It starts a real TP=2 group: 40-100 s on the 2-core reference machine, more than `make test` can spend on it.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("MMCAST_LIVE_CHART") != "1",
        reason="starts the rendered group pod as local processes (40-100 s): set MMCAST_LIVE_CHART=1",
    ),
]


def _free_run(n: int) -> int:
    """The first of n consecutive free loopback ports (rank i listens on base + i)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65536:
            continue
        try:
            socks = []
            for port in range(base, base + n):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="mmcast.v1.GenerationService"), timeout=2
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_rendered_group_pod_forms_its_group_on_loopback_and_serves(tiny_model_dir, tmp_path):
    # Rank i uses grpcPort+i and metricsPort+i.
    grpc_port, metrics_port, http_port, rank_grpc, rank_metrics, dist = (_free_run(2) for _ in range(6))
    objects = render(
        (CI_VALUES / "cpu-tiny-values.yaml",),
        (
            f"scheduler.grpcPort={grpc_port}",
            f"scheduler.metricsPort={metrics_port}",
            f"scheduler.http.port={http_port}",
            f"worker.grpcPort={rank_grpc}",
            f"worker.metricsPort={rank_metrics}",
            f"worker.distPort={dist}",
        ),
    )
    group = find(objects, "StatefulSet", "-group")
    token = tmp_path / "token"
    token.write_text("stand-in-token-0123456789abcdef\n")
    procs = []
    try:
        for c in pod_spec(group)["containers"]:
            args = [
                a.replace("/models/tiny", str(tiny_model_dir)).replace("/etc/mmcast/worker-token/token", str(token))
                for a in c["args"]
            ]
            env = {
                **os.environ,
                **{e["name"]: e["value"] for e in c["env"] if "value" in e},
                "HOME": str(tmp_path),
                "XDG_CACHE_HOME": str(tmp_path / ".cache"),
            }
            log = open(tmp_path / f"{c['name']}.log", "w")  # closed in the finally below, with the process
            procs.append(
                (c["name"], subprocess.Popen(c["command"] + args, env=env, stdout=log, stderr=subprocess.STDOUT), log)
            )
        deadline = time.monotonic() + 240
        while not _serving(grpc_port):
            dead = [(n, p.returncode) for n, p, _ in procs if p.poll() is not None]
            assert not dead and time.monotonic() < deadline, f"group did not form: exited {dead}; logs:\n" + "\n".join(
                f"--- {n}\n" + (tmp_path / f"{n}.log").read_text()[-2000:] for n, _, _ in procs
            )
            time.sleep(1)
        from mmcast_client import Client

        with Client(f"127.0.0.1:{grpc_port}") as client:
            result = client.generate("Hello there", max_tokens=4, ignore_eos=True)
        assert result.usage.completion_tokens == 4
    finally:
        for _, p, _log in procs:
            p.terminate()
        for _, p, log in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            log.close()
