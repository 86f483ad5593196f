"""A real Envoy process running deploy/envoy/envoy.yaml in front of local replicas.

The repository's file is used as is — routes, hash policies, stateful session, retries, health checks — except for
what only a deployment knows: the listener and admin ports (free loopback ports here) and the endpoints, which the
file resolves from the headless Service (STRICT_DNS) and the test lists itself (STATIC, one per LocalGroup).
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from mmcast_local.child_processes import free_ports
from tests.support.deploy_tools import ROOT, tool

CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"
CLUSTER_PORTS = {"mmcast_grpc": "port", "mmcast_http": "http_port"}  # cluster -> the LocalGroup attribute it targets


def config_for(groups, listen_port: int, admin_port: int) -> dict:
    """deploy/envoy/envoy.yaml with loopback ports and the groups as static endpoints."""
    config = yaml.safe_load(CONFIG.read_text())
    config = copy.deepcopy(config)
    config["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin_port)
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"].update(address="127.0.0.1", port_value=listen_port)
    for cluster in config["static_resources"]["clusters"]:
        attr = CLUSTER_PORTS[cluster["name"]]
        cluster["type"] = "STATIC"
        cluster.pop("dns_lookup_family", None)
        cluster["load_assignment"]["endpoints"] = [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": g.host, "port_value": getattr(g, attr)}}}}
                    for g in groups
                ]
            }
        ]
    return config


class Envoy:
    """``with Envoy(groups, tmp_path) as envoy:`` — ``envoy.target`` (gRPC) and ``envoy.base_url`` (HTTP)."""

    def __init__(self, groups, folder: Path) -> None:
        self.groups = groups
        self.listen_port, self.admin_port = free_ports(2)
        self.config_file = folder / "envoy.yaml"
        self.config_file.write_text(yaml.safe_dump(config_for(groups, self.listen_port, self.admin_port)))
        self.log_file = folder / "envoy.log"
        self.proc: subprocess.Popen | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.listen_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    def __enter__(self) -> Envoy:
        with open(self.log_file, "wb") as log:
            # --disable-hot-restart: no shared-memory segment, so Envoys of parallel test runs never collide.
            self.proc = subprocess.Popen(
                [
                    tool("envoy"),
                    "-c",
                    str(self.config_file),
                    "--disable-hot-restart",
                    "--concurrency",
                    "2",
                    "--log-level",
                    "warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.wait_healthy(len(self.groups))
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def admin(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}{path}", timeout=5) as r:  # noqa: S310
            return r.read().decode()

    def healthy_hosts(self) -> dict[str, int]:
        """Cluster -> how many of its hosts pass their active health check."""
        clusters = json.loads(self.admin("/clusters?format=json"))["cluster_statuses"]
        out = {}
        for c in clusters:
            statuses = [h.get("health_status", {}) for h in c.get("host_statuses", [])]
            out[c["name"]] = sum(
                not s.get("failed_active_health_check")
                and not s.get("failed_outlier_check")
                and s.get("eds_health_status", "HEALTHY") == "HEALTHY"
                for s in statuses
            )
        return out

    def wait_healthy(self, count: int, timeout: float = 60) -> None:
        """Until every cluster has exactly ``count`` healthy hosts (Envoy's own view, from its health checks)."""
        deadline = time.monotonic() + timeout
        seen: dict = {}
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"envoy exited {self.proc.returncode}:\n{self.log_file.read_text()[-3000:]}")
            try:
                seen = self.healthy_hosts()
                if set(seen) == set(CLUSTER_PORTS) and all(n == count for n in seen.values()):
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise AssertionError(
            f"envoy: healthy hosts {seen} after {timeout}s, want {count} per cluster\n"
            f"{self.log_file.read_text()[-3000:]}"
        )

    def stat(self, name: str) -> int:
        for line in self.admin("/stats?filter=" + name).splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
        raise KeyError(name)


def replica_of(header_value: str, groups) -> int:
    """Which group served an answer, from Envoy's x-mmcast-replica header (base64 of the upstream "ip:port")."""
    address = base64.b64decode(header_value).decode()
    host, _, port = address.rpartition(":")
    for i, g in enumerate(groups):
        if host == g.host and int(port) in (g.port, g.http_port):
            return i
    raise AssertionError(f"x-mmcast-replica {header_value!r} = {address} is none of the replicas")
