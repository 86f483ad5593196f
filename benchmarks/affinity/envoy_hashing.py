"""How many conversations Envoy's consistent hashing moves between *surviving* replicas when one replica leaves:
the measurement behind deploy/envoy/envoy.yaml's choice of MAGLEV over RING_HASH (docs/DEPLOYMENT.md §4).

    .venv/bin/python -m benchmarks.affinity.envoy_hashing            # both policies, 300 keys, 3 upstreams

A real Envoy (`make tools`) runs deploy/envoy/envoy.yaml with its HTTP cluster's endpoints set to three loopback
HTTP servers that answer `/health` with their own port (only the hashing is measured here, so no model is loaded;
tests/service/test_envoy_e2e.py runs the same file in front of real replicas). Each key is sent as `x-session-id`;
one upstream is then shut down, its health check fails, and the keys are sent again. A key that was on a survivor
and now answers from another survivor lost its cache for nothing.
"""

from __future__ import annotations

import argparse
import http.server
import socketserver
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

from mmcast_local.child_processes import free_ports

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "deploy" / "envoy" / "envoy.yaml"
ENVOY = ROOT / ".tools" / "bin" / "envoy"


class _Port(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = str(self.server.server_address[1]).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def measure(policy: str, keys: int, upstreams: int = 3) -> tuple[int, int, int]:
    """(keys on the upstream that leaves, keys on the survivors, of which moved to another survivor)."""
    ports = free_ports(upstreams + 2)
    up, listen, admin = ports[:upstreams], ports[upstreams], ports[upstreams + 1]
    servers = []
    for port in up:
        server = socketserver.ThreadingTCPServer(("127.0.0.1", port), _Port)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    config = yaml.safe_load(CONFIG.read_text())
    config["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=admin)
    config["static_resources"]["listeners"][0]["address"]["socket_address"].update(
        address="127.0.0.1", port_value=listen
    )
    for cluster in config["static_resources"]["clusters"]:
        cluster.update(type="STATIC", lb_policy=policy)
        cluster.pop("dns_lookup_family", None)
        targets = up if cluster["name"] == "mmcast_http" else [1]  # the gRPC cluster is not used here
        cluster["load_assignment"]["endpoints"] = [
            {
                "lb_endpoints": [
                    {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
                    for p in targets
                ]
            }
        ]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "envoy.yaml"
        path.write_text(yaml.safe_dump(config))
        envoy = subprocess.Popen([str(ENVOY), "-c", str(path), "--disable-hot-restart", "--log-level", "error"])
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{listen}", timeout=5) as client:

                def where() -> dict[int, str]:
                    return {k: client.get("/health", headers={"x-session-id": f"user-{k}"}).text for k in range(keys)}

                deadline = time.monotonic() + 30
                while True:  # until every upstream passed its first health check
                    try:
                        if len(set(where().values())) == upstreams:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("envoy did not route to every upstream within 30 s")
                    time.sleep(0.5)
                before = where()
                servers[0].shutdown()
                servers[0].server_close()
                gone = str(up[0])
                deadline = time.monotonic() + 30
                while gone in where().values():  # until the health check took it out
                    if time.monotonic() > deadline:
                        raise RuntimeError("envoy kept routing to the stopped upstream for 30 s")
                    time.sleep(0.5)
                after = where()
        finally:
            envoy.terminate()
            envoy.wait(10)
            for server in servers[1:]:
                server.shutdown()
                server.server_close()
    survivors = [k for k in before if before[k] != gone]
    return keys - len(survivors), len(survivors), sum(after[k] != before[k] for k in survivors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=300, help="conversation keys to route (default 300)")
    args = parser.parse_args()
    for policy in ("RING_HASH", "MAGLEV"):
        on_gone, on_survivors, moved = measure(policy, args.keys)
        print(
            f"{policy:9s}: {on_gone} keys on the upstream that left, {on_survivors} on the survivors, "
            f"{moved} of these moved to another survivor"
        )


if __name__ == "__main__":
    main()
