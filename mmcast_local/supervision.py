"""How a local group (supervisor.py) is kept running: the supervisor thread's loop, which restarts the worker group
or the scheduler when one exits, gives up after too many restarts in a window, and never restarts a process that
failed its start-up (common/process.py's EXIT_STARTUP_FAILURE)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from common.process import EXIT_STARTUP_FAILURE, startup_failure_cause
from mmcast_local.child_processes import Child

log = logging.getLogger("mmcast_local.supervisor")


class Supervision:
    """The supervision of ``LocalGroup`` (mixed into it; its attributes are the group's)."""

    def _supervise(self) -> None:
        try:
            self._start_workers()
            self._spawn(self.scheduler)
        except BaseException as e:  # noqa: BLE001 - handed to start()'s caller
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        try:
            while not self._stopping.wait(0.2):
                dead = [c for c in self.workers if c.process is not None and c.process.poll() is not None]
                if dead:
                    if self._gave_up_on_startup(dead):
                        break
                    codes = ", ".join(f"{c.name} exit {c.process.returncode}" for c in dead)
                    if not self._may_restart(f"worker group ({codes})"):
                        break
                    self._terminate(self.workers, grace=min(self.grace_seconds, 2.0))
                    self._start_workers()
                if self.scheduler.process is not None and self.scheduler.process.poll() is not None:
                    if self._gave_up_on_startup([self.scheduler]):
                        break
                    code = self.scheduler.process.returncode
                    if not self._may_restart(f"scheduler (exit {code})"):
                        break
                    self._spawn(self.scheduler)
        finally:
            self._terminate([self.scheduler, *self.workers])

    def _gave_up_on_startup(self, dead: Sequence[Child]) -> bool:
        """True (and `failure` set to the cause) when every process in `dead` exited with `EXIT_STARTUP_FAILURE`.

        One killed by a signal or crashed among them makes it a crash: a rank whose peer was killed while the group
        formed or loaded may fail its own start-up, and a restart cures that."""
        if any(c.process.returncode != EXIT_STARTUP_FAILURE for c in dead):
            return False
        child = dead[0]
        cause = startup_failure_cause(self._last_run_log(child)) or (
            f"exited with status {EXIT_STARTUP_FAILURE} (start-up failure); see {child.log_path}"
        )
        self.failure = f"{child.name} could not start: {cause}"
        self.startup_failed = True
        log.error(self.failure)
        return True

    @staticmethod
    def _last_run_log(child: Child) -> str:
        """The child's log since its latest start (the file collects every restart, each after a `=== ` line)."""
        try:
            lines = child.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return ""
        starts = [i for i, line in enumerate(lines) if line.startswith("=== ") and " start: " in line]
        return "\n".join(lines[starts[-1] + 1 :] if starts else lines)

    def _may_restart(self, what: str) -> bool:
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < self.restart_window_seconds]
        if len(self._restart_times) >= self.max_restarts:
            self.failure = (
                f"{what} exited; gave up after {self.max_restarts} restarts within {self.restart_window_seconds:.0f} s"
            )
            log.error(self.failure)
            return False
        # A crash loop should not spin: the first restart is immediate, then 0.5 s, 1 s, 2 s, ... apart.
        delay = 0.0 if not self._restart_times else min(8.0, 0.5 * 2 ** (len(self._restart_times) - 1))
        self._restart_times.append(now)
        self.restarts += 1
        log.warning("restarting the %s in %.1f s", what, delay)
        return not self._stopping.wait(delay)
