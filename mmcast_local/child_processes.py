"""The child processes of a local group (supervisor.py), their ports and environment: the launcher every child runs
first, the command of each service, ports free to listen on below the ephemeral range, the group's ports, and the
environment every child gets."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import pathlib
import secrets
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping

from common.process import ALLOCATOR_ENV

# Runs first in every child, then execs the real command. A preexec_fn would run Python between fork and exec in
# a process whose gRPC threads (the supervisor's clients and health checks) did not survive the fork; gRPC's fork
# handlers then abort the child now and then. The launcher costs one interpreter start-up (~30 ms).
LAUNCHER = """\
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the supervisor thread
if os.getppid() != int(sys.argv[1]):  # the supervisor died before prctl took effect
    os._exit(1)
if sys.argv[2]:  # the CPUs this child is pinned to (cpu_plan); kept across exec, before any thread exists
    os.sched_setaffinity(0, [int(c) for c in sys.argv[2].split(",")])
os.execvp(sys.argv[3], sys.argv[3:])
"""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


# Listening ports are drawn below the kernel's ephemeral range: a port the OS hands out for `bind(0)` lies inside
# it, where any outgoing connection (a rank's rendezvous, a health check) may take it before the child binds it.
_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_LISTEN_PORTS = (10000, 32767)  # used when the ephemeral range is unknown or leaves too little room below it


def listen_port_range() -> tuple[int, int]:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _LISTEN_PORTS
    return (10000, low - 1) if low > 12000 else _LISTEN_PORTS


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free now, below the ephemeral range where one can (all sockets held open until all
    are chosen); ports the OS picks where none below is free."""
    low, high = listen_port_range()
    rng = secrets.SystemRandom()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            for _attempt in range(64):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                try:
                    s.bind((host, rng.randint(low, high)))
                except OSError:
                    s.close()
                    continue
                break
            else:
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def group_ports(
    tp: int, host: str, port: int, http_port: int | None, metrics_port_base: int | None
) -> tuple[int, int | None, list[int], list[int]]:
    """(scheduler gRPC, HTTP or None, each rank's, the metrics ports: scheduler, rank0, rank1, ...); 0, and the
    metrics ports without a base, take free ones."""
    n_free = (port == 0) + (http_port == 0) + tp + (0 if metrics_port_base else 1 + tp)
    spare = free_ports(n_free, host)
    port = port or spare.pop()
    http_port = None if http_port is None else (http_port or spare.pop())  # the OpenAI API; None: off
    worker_ports = [spare.pop() for _ in range(tp)]
    if metrics_port_base:
        metrics_ports = [metrics_port_base + i for i in range(1 + tp)]
    else:
        metrics_ports = [spare.pop() for _ in range(1 + tp)]
    return port, http_port, worker_ports, metrics_ports


def children_env(base: Mapping[str, str], tp: int, host: str, pinned: bool) -> dict[str, str]:
    """The children's environment: ``base``, the allocator settings, each rank's share of the CPUs, loopback
    sockets for a loopback group."""
    env = dict(base)
    env.update(ALLOCATOR_ENV)
    env.update({"MMCAST_ALLOCATOR_ENV_SET": "1", "PYTHONUNBUFFERED": "1"})
    # The tp ranks share this machine's CPUs with the scheduler and the clients: each rank takes an equal share
    # of torch threads by default, after one CPU is left to the rest (as vLLM's CPU engine reserves one).
    # Pinned, each rank is alone on its slice of CPUs: its default threads are the slice's.
    env.setdefault("MMCAST_LOCAL_RANKS", "1" if pinned else str(tp))
    env.setdefault("MMCAST_RESERVED_CPUS", "0" if pinned else "1")
    if is_loopback(host):  # the ranks' gloo (CPU) / NCCL (GPU) sockets: loopback like every other port
        env.update({"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"})
    return env


def command_for(script: str, module: str) -> list[str]:
    """$MMCAST_<SCRIPT>_COMMAND (shell words) if set, else the console script installed beside this interpreter,
    else `python -m module`."""
    override = os.environ.get("MMCAST_" + script.removeprefix("mmcast-").upper() + "_COMMAND")
    if override:
        return shlex.split(override)
    beside = pathlib.Path(sys.executable).parent / script
    if beside.exists():
        return [str(beside)]
    return [sys.executable, "-m", module]


@dataclasses.dataclass
class Child:
    name: str  # "scheduler" or "rank<r>"
    argv: list[str]
    log_path: pathlib.Path
    process: subprocess.Popen | None = None
