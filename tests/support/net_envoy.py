"""The repository's Envoy (tests/support/envoy.py: deploy/envoy/envoy.yaml as is) in a network namespace of a
NetLab, in front of replicas living in namespaces of their own (NetGroups), so a replica can be partitioned away from
Envoy as a pod is from its proxy. The test reaches Envoy's listener and admin port through relays."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import yaml

from tests.support.deploy_tools import tool
from tests.support.envoy import Envoy, config_for
from tests.support.netlab import NetLab
from tests.support.netns_relay import Relay

LISTEN_PORT, ADMIN_PORT = 10000, 9901  # inside Envoy's own namespace: nothing else listens there


class EdgeEnvoy(Envoy):
    def __init__(self, lab: NetLab, groups, folder: Path) -> None:
        self.lab, self.groups = lab, groups
        self.node = lab.node("edge")
        upstreams = [SimpleNamespace(host=g.sched.address, port=g.port, http_port=g.http_port) for g in groups]
        config = config_for(upstreams, LISTEN_PORT, ADMIN_PORT)
        config["admin"]["address"]["socket_address"]["address"] = self.node.address
        config["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] = self.node.address
        self.config_file = folder / "envoy.yaml"
        self.config_file.write_text(yaml.safe_dump(config))
        self.log_file = folder / "envoy.log"
        self.proc: subprocess.Popen | None = None
        self.relay = Relay(self.node.netns)
        self.listen_port = self.relay.add(self.node.address, LISTEN_PORT)
        self.admin_port = self.relay.add(self.node.address, ADMIN_PORT)
        self.relay.start()

    def __enter__(self) -> EdgeEnvoy:
        argv = [tool("envoy"), "-c", str(self.config_file), "--disable-hot-restart", "--concurrency", "2"]
        with open(self.log_file, "wb") as log:
            self.proc = self.lab.exec(self.node, [*argv, "--log-level", "warn"], stdout=log, stderr=subprocess.STDOUT)
        self.wait_healthy(len(self.groups))
        return self

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.relay.stop()

    def replica_of(self, header_value: str) -> int:
        """Which group served an answer, from Envoy's x-mmcast-replica header (base64 of the upstream ip:port)."""
        import base64

        host = base64.b64decode(header_value).decode().rpartition(":")[0]
        return [g.sched.address for g in self.groups].index(host)
