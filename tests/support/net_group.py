"""A supervised local deployment (``LocalGroup``: the scheduler and an N-rank group, restarted as serve-local does)
whose every process lives in its own network namespace of a ``NetLab``.

- the scheduler in node ``sched``, rank r in node ``rank<r>``; every listening port binds the node's lab address;
- the scheduler reaches the ranks at their lab addresses, and the ranks' torch.distributed rendezvous and gloo
  sockets use their ``eth0`` (``GLOO_SOCKET_IFNAME``), with ``--cpu-allreduce gloo`` so the collectives cross the
  links instead of shared memory: a fault of a link is a fault of the traffic it carries;
- the test reaches the scheduler's ports (gRPC, HTTP, /metrics) and the ranks' (health, /metrics) through relays
  on its own 127.0.0.1 (``tests/support/netns_relay.py``), so ``target``, ``openai_base_url``, ``worker_targets``
  and ``metrics_urls`` work as for a plain LocalGroup.
"""

from __future__ import annotations

from mmcast_local.supervisor import LocalGroup
from tests.support.netlab import IFNAME, NetLab, Node
from tests.support.netns_relay import Relay


class NetGroup(LocalGroup):
    LOCAL_STREAMS = False  # the ranks' Step streams cross the lab's links (which tests cut), not a shared socket

    def __init__(self, lab: NetLab, model_dir, tp: int = 2, transfer_mode: str = "lazy", *, name: str = "", **kw):
        """``name``: prefix of the nodes' names, so several groups (replicas) share one lab."""
        self.lab = lab
        self.sched: Node = lab.node(f"{name}sched")
        self.ranks: list[Node] = [lab.node(f"{name}rank{r}") for r in range(tp)]
        self._relayed: dict[tuple[str, int], int] = {}  # (netns, port) -> the relay's 127.0.0.1 port
        super().__init__(model_dir, tp, transfer_mode, **kw)
        self.env.update({"GLOO_SOCKET_IFNAME": IFNAME, "NCCL_SOCKET_IFNAME": IFNAME})
        self.worker_args = ["--cpu-allreduce", "gloo", *self.worker_args]
        self._relays = [Relay(self.sched.netns)] + [Relay(n.netns) for n in self.ranks]
        for port in [self.port, self.http_port, self.metrics_ports[0]]:
            if port is not None:
                self._relayed[(self.sched.netns, port)] = self._relays[0].add(self.sched.address, port)
        for r, node in enumerate(self.ranks):
            for port in (self.worker_ports[r], self.metrics_ports[1 + r]):
                self._relayed[(node.netns, port)] = self._relays[1 + r].add(node.address, port)
        for relay in self._relays:
            relay.start()

    # -- what the test sees: the relays ------------------------------------------------------------------------------
    def _local(self, node: Node, port: int) -> str:
        relayed = self._relayed.get((node.netns, port))
        return f"127.0.0.1:{relayed}" if relayed else f"{node.address}:{port}"

    @property
    def target(self) -> str:
        return self._local(self.sched, self.port)

    @property
    def worker_targets(self) -> list[str]:
        return [self._local(node, p) for node, p in zip(self.ranks, self.worker_ports, strict=True)]

    @property
    def openai_base_url(self) -> str | None:
        return None if self.http_port is None else f"http://{self._local(self.sched, self.http_port)}/v1"

    @property
    def metrics_urls(self) -> dict[str, str]:
        out = {"scheduler": f"http://{self._local(self.sched, self.metrics_ports[0])}/metrics"}
        for r, node in enumerate(self.ranks):
            out[f"rank{r}"] = f"http://{self._local(node, self.metrics_ports[1 + r])}/metrics"
        return out

    @property
    def lab_targets(self) -> dict[str, str]:
        """The scheduler's gRPC and HTTP addresses inside the lab (for a proxy living in another node)."""
        return {"grpc": f"{self.sched.address}:{self.port}", "http": f"{self.sched.address}:{self.http_port}"}

    # -- what the processes see: lab addresses, one namespace each -----------------------------------------------------
    def _node(self, child: str) -> Node:
        return self.sched if child == "scheduler" else self.ranks[int(child.removeprefix("rank"))]

    def _address_of(self, child: str) -> str:
        return self._node(child).address

    def _launch_prefix(self, child: str) -> list[str]:
        return NetLab.prefix(self._node(child))

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            for relay in self._relays:
                relay.stop()
