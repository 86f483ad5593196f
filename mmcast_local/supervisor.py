"""One scheduler and an N-rank worker group as local processes on loopback, supervised.

    with LocalGroup(model_dir, tp=2, transfer_mode="lazy") as group:   # start() + wait_ready()
        with Client(group.target) as client:
            ...
        group.metrics_urls  # {"scheduler": "http://127.0.0.1:Q/metrics", "rank0": ..., ...}
        group.openai_base_url  # "http://127.0.0.1:H/v1": the OpenAI-compatible API (http_port=None: off)

Supervision: if any rank exits, every rank is stopped and the whole group restarted with a fresh
torch.distributed port (the ranks keep their gRPC ports, so the scheduler reconnects by itself); if the scheduler
exits, it alone is restarted. After `max_restarts` restarts within `restart_window_seconds` the group is given up
(`failure` says why). A process that exits with `EXIT_STARTUP_FAILURE` (common/process.py: a bad flag, a checkpoint
the rules of common/model_checks.py reject, a model that does not load) is not restarted: no restart would cure it,
so the group stops at once and `failure` is the cause that process logged, as one line (`wait_ready` raises
`StartupFailure` with it). The TP size is checked against the checkpoint's config.json before anything starts,
naming `--tp`. Every child runs in its own process group with PR_SET_PDEATHSIG, so none outlives the
supervisor, even one killed with SIGKILL; all spawning happens on one long-lived supervisor thread because the
kernel ties PDEATHSIG to the thread that forked the child.

Security: the group gets a fresh shared secret (a 0600 file in a private 0700 folder, removed on stop; never on a
command line): the scheduler sends it on every rank stream (`--worker-token-file`) and each rank demands it
(`--shared-token-file`). Every port — client (gRPC and HTTP), ranks, /metrics, the torch.distributed rendezvous and the ranks' gloo
sockets — binds `host` (default 127.0.0.1) alone. Flags in `scheduler_args`/`worker_args` come last and win.

Part of the server distribution (it starts the services and polls them with grpcio-health-checking); the SDK never
imports it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

from common.model_checks import check_checkpoint
from mmcast_local.child_processes import LAUNCHER, Child, children_env, command_for, free_ports, group_ports
from mmcast_local.cpu_pinning import cpu_plan
from mmcast_local.supervision import Supervision

log = logging.getLogger("mmcast_local.supervisor")

TRANSFER_MODES = ("full", "strip", "lazy")
GENERATION_SERVICE = "mmcast.v1.GenerationService"
WORKER_SERVICE = "mmcast.v1.WorkerService"


def _check_arguments(model_dir, tp: int, transfer_mode: str, port: int, http_port, metrics_port_base) -> None:
    """ValueErrors naming the argument, before anything starts."""
    if tp < 1:
        raise ValueError(f"tp={tp} must be >= 1")
    if transfer_mode not in TRANSFER_MODES:
        raise ValueError(f"transfer_mode={transfer_mode!r}; choose one of {TRANSFER_MODES}")
    if not 0 <= port <= 65535:
        raise ValueError(f"port={port} must be in [0, 65535] (0 picks a free one)")
    if http_port is not None and not 0 <= http_port <= 65535:
        raise ValueError(f"http_port={http_port} must be in [0, 65535] (0 picks a free one; None: no HTTP API)")
    if metrics_port_base is not None and not 1 <= metrics_port_base <= 65535 - tp:
        raise ValueError(f"metrics_port_base={metrics_port_base} must be in [1, {65535 - tp}]")
    if os.path.isfile(os.path.join(model_dir, "config.json")):  # else the processes say what is missing
        check_checkpoint(model_dir, tp, "--tp")  # ModelConfigError (a ValueError), one line naming --tp


class StartupFailure(RuntimeError):
    """A process of the group refused to start for a reason a restart cannot cure; the message is its cause."""


class LocalGroup(Supervision):
    """A supervised local mmcast deployment; see the module docstring."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        tp: int = 1,
        transfer_mode: str = "lazy",
        *,
        port: int = 0,
        http_port: int | None = 0,
        host: str = "127.0.0.1",
        metrics_port_base: int | None = None,
        kv_blocks: int | None = None,
        scheduler_args: Sequence[str] = (),
        worker_args: Sequence[str] = (),
        log_dir: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 180.0,
        grace_seconds: float = 5.0,
        max_restarts: int = 5,
        restart_window_seconds: float = 300.0,
        scheduler_command: Sequence[str] | None = None,
        worker_command: Sequence[str] | None = None,
        pin_cpus: bool = False,
        local_streams: bool = True,
    ) -> None:
        """`scheduler_command` / `worker_command`: the program to run instead of the installed `mmcast-scheduler`
        / `mmcast-worker` (e.g. under a profiler, or a stand-in in tests); the flags are appended to it. The
        environment variables MMCAST_SCHEDULER_COMMAND / MMCAST_WORKER_COMMAND do the same for serve-local.
        `pin_cpus`: pin the scheduler and each rank to CPUs of their own where there are enough (`cpu_plan`).
        `local_streams`: the scheduler reaches each rank's Step stream on a Unix-domain socket in the group's 0700
        secret folder (common/local_stream.py: no gRPC threads per message); False: over gRPC on the rank's port."""
        _check_arguments(model_dir, tp, transfer_mode, port, http_port, metrics_port_base)
        self.model_dir = str(model_dir)
        self.tp = tp
        self.transfer_mode = transfer_mode
        self.host = host
        self.kv_blocks = kv_blocks
        self.scheduler_args = list(scheduler_args)
        self.worker_args = list(worker_args)
        self.ready_timeout = ready_timeout
        self.grace_seconds = grace_seconds
        self.max_restarts = max_restarts
        self.restart_window_seconds = restart_window_seconds
        self.scheduler_command = list(scheduler_command or command_for("mmcast-scheduler", "scheduler_svc.main"))
        self.worker_command = list(worker_command or command_for("mmcast-worker", "worker_svc.main"))
        self._own_log_dir = log_dir is None
        self.log_dir = pathlib.Path(log_dir or tempfile.mkdtemp(prefix="mmcast-local-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)

        # Ports: fixed for the life of the group so the scheduler can always reconnect to the same addresses.
        self.port, self.http_port, self.worker_ports, self.metrics_ports = group_ports(
            tp, host, port, http_port, metrics_port_base
        )
        self.cpus = cpu_plan(sorted(os.sched_getaffinity(0)), tp) if pin_cpus else None
        self.env = children_env(os.environ if env is None else env, tp, host, pinned=bool(self.cpus))
        self.local_streams = local_streams and self.LOCAL_STREAMS
        self.token_file = self._write_secret()  # removed by stop()

        self.dist_port: int | None = None  # torch.distributed rendezvous port of the current worker group
        self.generation = 0  # incremented on every (re)start of the worker group
        self.restarts = 0  # restarts of the worker group or the scheduler after an exit
        self.failure: str | None = None  # set when the supervisor gave up
        self.startup_failed = False  # the failure is a process's start-up failure (its cause), not a crash loop
        self._restart_times: list[float] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.scheduler = Child("scheduler", self._scheduler_argv(), self.log_dir / "scheduler.log")
        self.workers = [Child(f"rank{r}", [], self.log_dir / f"rank{r}.log") for r in range(tp)]

    # A subclass whose processes live apart (tests: a network namespace each, links cut on purpose) keeps gRPC.
    LOCAL_STREAMS = True

    def step_socket(self, rank: int) -> str:
        return str(self._secret_dir / f"rank{rank}.sock")

    def _write_secret(self) -> pathlib.Path:
        """The group's shared token, in a 0600 file inside a fresh 0700 folder (``mkdtemp``)."""
        self._secret_dir = pathlib.Path(tempfile.mkdtemp(prefix="mmcast-secret-"))
        path = self._secret_dir / "worker-token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        return path

    # -- addresses -------------------------------------------------------------------------------------------------
    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def worker_targets(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.worker_ports]

    @property
    def openai_base_url(self) -> str | None:
        """The OpenAI-compatible API's base URL (``http://127.0.0.1:PORT/v1``), or None when it is off."""
        return None if self.http_port is None else f"http://{self.host}:{self.http_port}/v1"

    @property
    def metrics_urls(self) -> dict[str, str]:
        names = ["scheduler"] + [f"rank{r}" for r in range(self.tp)]
        return {name: f"http://{self.host}:{p}/metrics" for name, p in zip(names, self.metrics_ports, strict=True)}

    def pids(self) -> dict[str, int | None]:
        with self._lock:
            return {c.name: (c.process.pid if c.process else None) for c in [self.scheduler, *self.workers]}

    def describe(self) -> dict:
        """What serve-local prints on its READY line."""
        return {
            "target": self.target,
            "openai_base_url": self.openai_base_url,
            "workers": self.worker_targets,
            "metrics": self.metrics_urls,
            "pids": self.pids(),
            "tp": self.tp,
            "transfer_mode": self.transfer_mode,
            "model": self.model_dir,
            "log_dir": str(self.log_dir),
            "cpus": self.cpus,
        }

    # -- lifecycle -------------------------------------------------------------------------------------------------
    def start(self) -> LocalGroup:
        if self._thread is not None:
            raise RuntimeError("LocalGroup.start() was already called")
        self._thread = threading.Thread(target=self._supervise, name="mmcast-local-group", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self.stop()
            raise self._start_error
        return self

    def wait_ready(self, timeout: float | None = None) -> None:
        """Blocks until every rank's `mmcast.v1.WorkerService` and the scheduler's `mmcast.v1.GenerationService` health are
        SERVING: the ranks have loaded the model and formed their group, and the scheduler has handshaken them."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        checks = [(target, WORKER_SERVICE) for target in self.worker_targets] + [(self.target, GENERATION_SERVICE)]
        channels = [grpc.insecure_channel(target) for target, _ in checks]
        try:
            stubs = [health_pb2_grpc.HealthStub(channel) for channel in channels]
            pending = 0
            while True:
                if self.failure:
                    if self.startup_failed:
                        raise StartupFailure(self.failure)
                    raise RuntimeError(f"the local group failed: {self.failure}\n{self.log_tails()}")
                if self._stopping.is_set():
                    raise RuntimeError("the local group was stopped while waiting for readiness")
                # Checked in order (ranks first, the scheduler last); pending = the first not yet serving.
                while pending < len(checks) and self._serving(stubs[pending], checks[pending][1], health_pb2):
                    pending += 1
                if pending == len(checks):
                    return
                if time.monotonic() > deadline:
                    target, service = checks[pending]
                    raise TimeoutError(
                        f"the local group was not ready after {timeout:.0f} s: {service} at {target} is not "
                        f"SERVING\n{self.log_tails()}"
                    )
                time.sleep(0.1)
        finally:
            for channel in channels:
                channel.close()

    @staticmethod
    def _serving(stub, service: str, health_pb2) -> bool:
        import grpc

        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
        except grpc.RpcError:
            return False  # not listening yet, or the service is not registered yet
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stop(self) -> None:
        """Stops every process (SIGTERM to each process group, SIGKILL after `grace_seconds`); idempotent."""
        self._stopping.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._terminate([self.scheduler, *self.workers])  # no-op when the supervisor already did it
        shutil.rmtree(self._secret_dir, ignore_errors=True)
        if self._own_log_dir and os.environ.get("MMCAST_KEEP_LOGS") != "1":
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalGroup:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> int:
        """Sends `sig` to rank `rank`; returns the generation it belonged to (see `wait_restarted`)."""
        with self._lock:
            process = self.workers[rank].process
            generation = self.generation
        if process is None or process.poll() is not None:
            raise RuntimeError(f"rank {rank} is not running")
        process.send_signal(sig)
        return generation

    def wait_restarted(self, after_generation: int, timeout: float | None = None) -> None:
        """Blocks until the worker group has been restarted after `after_generation`, then until it is ready."""
        timeout = self.ready_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while self.generation <= after_generation:
            if self.failure:
                raise RuntimeError(f"the local group failed: {self.failure}\n{self.log_tails()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the worker group was not restarted within {timeout:.0f} s")
            time.sleep(0.05)
        self.wait_ready(max(1.0, deadline - time.monotonic()))

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for child in [self.scheduler, *self.workers]:
            try:
                text = child.log_path.read_text(errors="replace").splitlines()[-lines:]
            except FileNotFoundError:
                continue
            out.append(f"--- {child.log_path} (last {len(text)} lines)\n" + "\n".join(text))
        return "\n".join(out)

    # -- supervision (all on the supervisor thread) ----------------------------------------------------------------
    def _start_workers(self) -> None:
        # A fresh rendezvous port: a rank of the old group still in TIME_WAIT or a late peer must not join it.
        dist_port = self.dist_port
        while dist_port == self.dist_port:
            (dist_port,) = free_ports(1, self.host)
        self.dist_port = dist_port
        for r, child in enumerate(self.workers):
            child.argv = self._worker_argv(r, dist_port)
            self._spawn(child)
        with self._lock:
            self.generation += 1

    # Where each process lives, for a subclass that runs them elsewhere (tests: one network namespace each).
    def _address_of(self, child: str) -> str:
        """The address the child ("scheduler" or "rank<r>") binds and is reached at."""
        return self.host

    def _launch_prefix(self, child: str) -> list[str]:
        """A command the child's own command is run under (none here)."""
        return []

    def _worker_argv(self, rank: int, dist_port: int) -> list[str]:
        host, rank0 = self._address_of(f"rank{rank}"), self._address_of("rank0")
        argv = [
            *self._launch_prefix(f"rank{rank}"),
            *self.worker_command,
            "--rank", str(rank),
            "--world-size", str(self.tp),
            "--listen", f"{host}:{self.worker_ports[rank]}",
            "--dist-init", f"tcp://{rank0}:{dist_port}",
            "--model", self.model_dir,
            "--metrics-port", str(self.metrics_ports[1 + rank]),
            "--metrics-host", host,
            "--dist-bind-host", rank0,
            "--shared-token-file", str(self.token_file),
        ]  # fmt: skip
        if self.kv_blocks is not None:
            argv += ["--kv-blocks", str(self.kv_blocks)]
        if self.local_streams:
            argv += ["--step-socket", self.step_socket(rank)]
        return argv + self.worker_args

    def _scheduler_argv(self) -> list[str]:
        host = self._address_of("scheduler")
        workers = [
            f"local:{self.step_socket(r)}" if self.local_streams else f"{self._address_of(f'rank{r}')}:{p}"
            for r, p in enumerate(self.worker_ports)
        ]
        return [
            *self._launch_prefix("scheduler"),
            *self.scheduler_command,
            "--listen", f"{host}:{self.port}",
            "--metrics-port", str(self.metrics_ports[0]),
            "--metrics-host", host,
            "--worker-token-file", str(self.token_file),
            "--workers", ",".join(workers),
            "--model", self.model_dir,
            "--transfer-mode", self.transfer_mode,
            *(["--http-port", str(self.http_port)] if self.http_port is not None else []),
            *self.scheduler_args,
        ]  # fmt: skip

    def _spawn(self, child: Child) -> None:
        with open(child.log_path, "ab") as logf:
            logf.write(f"=== {time.strftime('%H:%M:%S')} start: {' '.join(child.argv)}\n".encode())
            logf.flush()
            process = subprocess.Popen(
                [sys.executable, "-c", LAUNCHER, str(os.getpid()), self._cpus_of(child), *child.argv],
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                env=self.env,
                process_group=0,  # its own process group, so stopping it also stops anything it started
                close_fds=True,
            )
        with self._lock:
            child.process = process

    def _cpus_of(self, child: Child) -> str:
        return "" if self.cpus is None else ",".join(str(c) for c in self.cpus[child.name])

    def _terminate(self, children: Sequence[Child], grace: float | None = None) -> None:
        """SIGTERM to each child's process group, then SIGKILL to the groups still alive after `grace`."""
        grace = self.grace_seconds if grace is None else grace
        running = [c.process for c in children if c.process is not None]
        for p in running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in running:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in running:
            # The group may outlive its leader (a child of the child): SIGKILL it whether or not the leader exited.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5)


def ready_line(group: LocalGroup) -> str:
    """The machine-readable line serve-local prints once the group is ready."""
    return "READY " + json.dumps(group.describe(), sort_keys=True)
