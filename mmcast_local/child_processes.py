"""The child processes of a local group (supervisor.py) and their ports: the launcher every child runs first, the
command of each service, ports free to listen on below the ephemeral range."""

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
