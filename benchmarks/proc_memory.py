"""A process's memory as Linux reports it in ``/proc/<pid>/status``: peak (``VmHWM``) and current (``VmRSS``) resident
set. Shared by the memory benchmarks and the tests that compare peaks."""

from __future__ import annotations


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
