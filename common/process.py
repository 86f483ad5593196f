"""Process set-up shared by the scheduler and worker entry points: allocator environment, JSON logs, CPU count, and
the exit status of a start-up failure."""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import time

# glibc reads these at start-up. With them, large protobuf messages reuse pre-faulted memory instead of
# refaulting fresh pages (a 16 MiB round trip costs 5 ms instead of 24 ms on the reference machine).
ALLOCATOR_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "4294967296",
    "MALLOC_TRIM_THRESHOLD_": "4294967296",
    "MALLOC_TOP_PAD_": "67108864",
}
_REEXEC_MARK = "MMCAST_ALLOCATOR_ENV_SET"


class StartupError(Exception):
    """A start-up failure a restart cannot cure. Its message is the one line the operator reads: what is wrong, where
    (the flag, the file or the folder) and what to change. Entry points log it with ``startup_failure()`` and exit
    with ``EXIT_STARTUP_FAILURE``."""


def ensure_allocator_env() -> None:
    """Re-exec the current process once with the allocator environment set, unless it already is.

    Set ``MMCAST_ALLOCATOR_ENV_SET=0`` to opt out (e.g. under a profiler that dislikes exec).
    """
    if os.environ.get(_REEXEC_MARK) is not None:
        return
    if all(os.environ.get(k) == v for k, v in ALLOCATOR_ENV.items()):
        return
    env = dict(os.environ, **ALLOCATOR_ENV, **{_REEXEC_MARK: "1"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


FROZEN_MESSAGE = "start-up heap frozen"


def freeze_startup_heap(logger: logging.Logger) -> int:
    """Puts every object alive once start-up is done (modules, configs, the tokenizer, the model's Python side:
    ~350k objects in a scheduler) out of the garbage collector's reach. A full collection walks every tracked
    object: ~0.2 s for a scheduler's start-up heap on a 2-core VM, a stall of whatever the process is serving at
    that moment; frozen, a collection walks only what serving has created. What is garbage already is collected
    first, so none of it is kept. Logs ``FROZEN_MESSAGE`` with the count; returns it."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info(FROZEN_MESSAGE, extra={"gc_frozen_objects": frozen, "seconds": round(time.perf_counter() - t0, 3)})
    return frozen


# Exit status of a scheduler or worker that refused to start for a reason a restart cannot cure: a bad flag, a
# checkpoint the configuration rules reject (common/model_checks.py), a model folder without a chat template or image
# processor (common/processor.py), a port it cannot bind. argparse exits with
# the same status on a bad flag. Supervisors (mmcast_local/supervisor.py) stop at once on it and show its cause;
# any other non-zero status is a crash, worth a restart. The process logs the cause first, as one line (a JSON log
# record with "startup_failure": true, see startup_failure()).
EXIT_STARTUP_FAILURE = 2


CGROUP_ROOT = "/sys/fs/cgroup"


def _cgroup_cpu_limit(root: str) -> float | None:
    """CPUs a cgroup quota allows (a container's CPU limit), or None when unlimited or unknown.

    Reads the cgroup mounted at ``root`` (in a container, its own cgroup): v2 ``cpu.max`` ("QUOTA PERIOD" or
    "max PERIOD"), else v1 ``cpu/cpu.cfs_quota_us`` and ``cpu/cpu.cfs_period_us`` (quota -1: unlimited).
    """
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def available_cpus(cgroup_root: str | None = None) -> int:
    """CPUs this process may use: its affinity mask (``os.sched_getaffinity``; taskset, cpusets, Kubernetes'
    static CPU manager), capped by the cgroup CPU quota (a container's CPU limit, which the affinity mask does
    not show), rounded down, at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # platforms without affinity masks
        count = os.cpu_count() or 1
    limit = _cgroup_cpu_limit(CGROUP_ROOT if cgroup_root is None else cgroup_root)
    if limit is not None:
        count = min(count, int(limit))
    return max(1, count)


def default_threads(local_ranks: int, cgroup_root: str | None = None, reserved: int = 0) -> int:
    """Torch threads of one of ``local_ranks`` processes sharing this process's CPUs, after ``reserved`` CPUs are left
    to the other processes beside them: an equal share, at least 1."""
    return max(1, (available_cpus(cgroup_root) - reserved) // max(1, local_ranks))


def iso_time(unix_seconds: float) -> str:
    """RFC 3339 UTC time with milliseconds, e.g. ``2026-12-01T20:52:08.123Z``: steps are milliseconds apart."""
    whole = int(unix_seconds)
    millis = int((unix_seconds - whole) * 1000)  # truncated, like the seconds
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object a line; extra attributes such as ``request_id`` become keys."""

    _STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "time": iso_time(record.created),
            "level": record.levelname.lower(),
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in self._STANDARD and not key.startswith("_"):
                out[key] = value if isinstance(value, str | int | float | bool | type(None)) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def setup_logging(component: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def startup_failure(logger: logging.Logger, cause: str, **fields: object) -> int:
    """Logs why this process cannot start and returns ``EXIT_STARTUP_FAILURE`` for its main to exit with.

    ``cause`` is the whole sentence a user reads (what is wrong, and the flag or file that fixes it): a supervisor
    prints it alone, as one line. ``fields`` go into the JSON record as keys.
    """
    logger.critical(cause, extra={"startup_failure": True, **fields})
    return EXIT_STARTUP_FAILURE


def startup_failure_cause(log_text: str) -> str | None:
    """The cause a process that exited with ``EXIT_STARTUP_FAILURE`` gave, from its log (stdout and stderr).

    The last JSON record marked ``"startup_failure": true`` (see ``startup_failure``), else argparse's
    ``PROG: error: ...`` line, else None.
    """
    usage_error = None
    for line in reversed(log_text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("startup_failure") is True:
                return str(record.get("msg", ""))
        elif usage_error is None and ": error: " in line:
            usage_error = line
    return usage_error
