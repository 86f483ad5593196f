"""Network namespaces joined by veth links, and the faults a pod network has: partitions (one direction or both),
flapping links and slow links.

    with NetLab() as lab:                      # skips the test where it cannot run (not root, no `ip netns`)
        a, b = lab.node("sched"), lab.node("rank0")
        lab.exec(a, ["mmcast-scheduler", ...])  # or the argv prefix lab.prefix(a)
        lab.drop(a, b)                         # a's packets to b vanish (b's to a still arrive)
        lab.partition(b)                       # b's link down: nothing in or out
        lab.rate_limit(b, "1mbit")             # tbf both ways on b's link

Topology: every node is a namespace with one interface, ``eth0``, addressed 10.77.0.N/24 and plugged into a bridge
living in a hub namespace of its own. The addresses exist only inside the lab's namespaces, so two labs never clash
and nothing outside them changes. The kernel here has neither netem nor tc actions nor iptables, so:

- a one-way drop is a permanent neighbour entry, in the sender's namespace, giving the peer's address a MAC address
  nobody owns: the frames leave and every receiver discards them, as a silent loss (no error reaches the sender);
- a partition of a node is its hub-side veth set down (carrier lost on both ends: no frame passes either way);
- a slow link is a ``tbf`` qdisc on both ends of the node's veth.

Cleanup: every namespace is named ``mmcnet-<pid>-<name>``; ``close`` kills what runs inside them (their pids, which
only the lab's processes can be) and deletes them, an ``atexit`` hook does the same if the test run dies first,
and ``cleanup_stale`` removes the namespaces of runs whose process is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import time

PREFIX = "mmcnet-"
SUBNET = "10.77.0"  # /24; lives only inside the lab's namespaces
BOGUS_MAC = "02:00:00:00:00:01"  # locally administered, owned by no interface of the lab
IFNAME = "eth0"  # the node's interface in every namespace (GLOO_SOCKET_IFNAME names it)


class NetLabUnavailable(RuntimeError):
    """This machine cannot run the lab (not root, no `ip` command, or network namespaces refused)."""


def unavailable_reason() -> str | None:
    """Why the lab cannot run here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (the chaos tests run as root in CI)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are missing"
    probe = f"{PREFIX}probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _namespaces() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped yet is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def delete_namespace(name: str) -> None:
    """Kill every process inside namespace ``name`` (by pid), then delete it."""
    pids = _ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline and any(pid_alive(int(p)) for p in pids):
        time.sleep(0.05)
    _ip("netns", "del", name, check=False)


def cleanup_stale() -> list[str]:
    """Delete the lab namespaces whose creating process no longer runs; returns their names."""
    removed = []
    for name in _namespaces():
        if not name.startswith(PREFIX):
            continue
        owner = name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            delete_namespace(name)
            removed.append(name)
    return removed


def lab_namespaces(pid: int | None = None) -> list[str]:
    """The namespaces of labs made by process ``pid`` (this one by default)."""
    mine = f"{PREFIX}{os.getpid() if pid is None else pid}-"
    return [n for n in _namespaces() if n.startswith(mine)]


@dataclasses.dataclass(frozen=True)
class Node:
    name: str  # the short name the test gave it
    netns: str  # the namespace
    address: str  # its eth0 address
    hub_if: str  # its veth's other end, in the hub namespace


class NetLab:
    """A hub namespace with a bridge and one namespace per node; see the module docstring."""

    _serial = 0

    def __init__(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetLabUnavailable(reason)
        cleanup_stale()
        NetLab._serial += 1
        self.tag = f"{PREFIX}{os.getpid()}-{NetLab._serial}"
        self.hub = f"{self.tag}-hub"
        self.nodes: dict[str, Node] = {}
        self.events: list[tuple[float, str]] = []  # (monotonic time, what was done): the fault log of a test
        self._closed = False
        atexit.register(self.close)
        _ip("netns", "add", self.hub)
        self._in(self.hub, "link", "set", "lo", "up")
        self._in(self.hub, "link", "add", "br0", "type", "bridge")
        self._in(self.hub, "link", "set", "br0", "up")

    # -- building ---------------------------------------------------------------------------------------------------
    def node(self, name: str) -> Node:
        """A new namespace plugged into the hub, with the next address."""
        if name in self.nodes:
            raise ValueError(f"node {name!r} exists already")
        index = len(self.nodes) + 1
        if index > 250:
            raise ValueError("a lab holds at most 250 nodes")
        node = Node(name, f"{self.tag}-{name}", f"{SUBNET}.{index}", f"h{index}")
        _ip("netns", "add", node.netns)
        _ip("link", "add", node.hub_if, "netns", self.hub, "type", "veth", "peer", "name", IFNAME, "netns", node.netns)
        self._in(node.netns, "addr", "add", f"{node.address}/24", "dev", IFNAME)
        self._in(node.netns, "link", "set", "lo", "up")
        self._in(node.netns, "link", "set", IFNAME, "up")
        self._in(self.hub, "link", "set", node.hub_if, "master", "br0")
        self._in(self.hub, "link", "set", node.hub_if, "up")
        self.nodes[name] = node
        return node

    @staticmethod
    def prefix(node: Node) -> list[str]:
        """The argv prefix that runs a command inside ``node``'s namespace (same pid, same environment)."""
        return ["ip", "netns", "exec", node.netns]

    def exec(self, node: Node, argv: list[str], **popen_kw) -> subprocess.Popen:
        return subprocess.Popen(self.prefix(node) + list(argv), **popen_kw)

    # -- faults -----------------------------------------------------------------------------------------------------
    def drop(self, src: Node, dst: Node) -> None:
        """``src``'s packets to ``dst`` are lost from now on (one direction)."""
        self._in(src.netns, "neigh", "replace", dst.address, "lladdr", BOGUS_MAC, "dev", IFNAME, "nud", "permanent")
        self._log(f"drop {src.name}->{dst.name}")

    def undrop(self, src: Node, dst: Node) -> None:
        self._in(src.netns, "neigh", "del", dst.address, "dev", IFNAME, check=False)
        self._log(f"undrop {src.name}->{dst.name}")

    def cut(self, a: Node, b: Node) -> None:
        """Both directions between ``a`` and ``b`` lost; their other links unharmed."""
        self.drop(a, b)
        self.drop(b, a)

    def mend(self, a: Node, b: Node) -> None:
        self.undrop(a, b)
        self.undrop(b, a)

    def partition(self, node: Node) -> None:
        """``node``'s link down: nothing in or out."""
        self._in(self.hub, "link", "set", node.hub_if, "down")
        self._log(f"down {node.name}")

    def heal(self, node: Node) -> None:
        self._in(self.hub, "link", "set", node.hub_if, "up")
        self._log(f"up {node.name}")

    def flap(self, node: Node, seconds: float, period: float = 1.0, stop=None) -> int:
        """Down for ``period``, up for ``period``, … for ``seconds``; ends up. Returns the number of downs."""
        downs = 0
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end and not (stop is not None and stop.is_set()):
                self.partition(node)
                downs += 1
                time.sleep(period)
                self.heal(node)
                time.sleep(period)
        finally:
            self.heal(node)
        return downs

    def rate_limit(self, node: Node, rate: str, direction: str = "both", latency: str = "500ms") -> None:
        """``tbf`` at ``rate`` (tc units: 1mbit) on ``node``'s link: what it sends (``out``), what it receives
        (``in``) or ``both``; ``latency`` bounds the queue."""
        ends = {"out": [(node.netns, IFNAME)], "in": [(self.hub, node.hub_if)]}
        for ns, dev in ends["out"] + ends["in"] if direction == "both" else ends[direction]:
            tbf = ["tbf", "rate", rate, "burst", "32kbit", "latency", latency]
            self._tc(ns, "qdisc", "replace", "dev", dev, "root", *tbf)
        self._log(f"rate {node.name} {direction} {rate}")

    def unlimit(self, node: Node) -> None:
        for ns, dev in ((node.netns, IFNAME), (self.hub, node.hub_if)):
            self._tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
        self._log(f"unlimit {node.name}")

    def link_stats(self, node: Node) -> dict[str, int]:
        """Bytes and packets through ``node``'s eth0 (rx/tx, as its kernel counts them)."""
        out = {}
        for key in ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets"):
            path = f"/sys/class/net/{IFNAME}/statistics/{key}"
            done = subprocess.run(self.prefix(node) + ["cat", path], capture_output=True, text=True)
            out[key] = int(done.stdout.strip() or 0)
        return out

    # -- teardown ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Kill everything running in the lab's namespaces and delete them; idempotent."""
        if self._closed:
            return
        self._closed = True
        for node in self.nodes.values():
            delete_namespace(node.netns)
        delete_namespace(self.hub)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------------------------------
    def _log(self, what: str) -> None:
        self.events.append((time.monotonic(), what))

    @staticmethod
    def _in(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _ip("-n", ns, *args, check=check)

    @staticmethod
    def _tc(ns: str, *args: str, check: bool = True) -> None:
        done = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
        if check and done.returncode != 0:
            raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {done.stderr.strip()}")
