"""A process's memory and CPU time as Linux reports them: peak (``VmHWM``) and current (``VmRSS``) resident set from
``/proc/<pid>/status``, CPU seconds from the process's CPU clock. Shared by the memory benchmarks, the per-request
CPU figures of the scenarios and the tests that compare peaks."""

from __future__ import annotations

import os
import time


def status_mib(pid: int | str = "self") -> dict[str, float]:
    """VmHWM (peak RSS) and VmRSS of a process, in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(line.split()[1]) / 1024
    return out


def peak_mib(pid: int | str = "self") -> float:
    """The process's peak resident set since it started or since ``reset_peak``, MiB."""
    return status_mib(pid)["VmHWM"]


def reset_peak(pid: int | str) -> None:
    """Resets the process's VmHWM to its current RSS (``/proc/<pid>/clear_refs``, value 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a whole process (every thread, living or exited) since it started.

    The same total as ``utime + stime`` of ``/proc/<pid>/stat``, which reports it in clock ticks (10 ms here): too
    coarse for what one image costs, so the process's CPU clock (``clock_getcpuclockid``: ``(~pid << 3) | 2``,
    nanoseconds) is read first and the ticks only where the kernel refuses it."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
