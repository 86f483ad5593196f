"""Where a benchmark run was made: the machine (CPU, cores, memory, load, allocator settings), the package versions
and the commit. Recorded in every results file; shared by the scenario runner (run.py) and the peer comparison."""

from __future__ import annotations

import os
import platform
import subprocess

from benchmarks.support.paths import ROOT


def machine_meta() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())  # fmt: skip
    mem_kb = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    return {"cpu": cpu, "cores": os.cpu_count(), "memory_gib": mem_kb / 2**20, "platform": platform.platform(),
            "loadavg_before": [round(x, 2) for x in os.getloadavg()],
            "allocator_env": {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                                              "MALLOC_TOP_PAD_")}}  # fmt: skip


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "grpcio", "protobuf", "numpy", "pillow", "prometheus-client", "matplotlib"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def git_meta() -> dict:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or "unknown", "dirty": bool(git("status", "--porcelain", "--", "."))}
