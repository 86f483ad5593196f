"""What both demos (demo.py, video_demo.py) print with: a progress bar on stderr and byte sizes in binary units."""

from __future__ import annotations

import shutil
import sys
import threading
import time


class Progress:
    """A one-line progress bar on stderr (redrawn in place on a terminal; silent otherwise)."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 28) -> None:
        self.total = total
        self.stream = stream
        self.width = width
        self.enabled = stream.isatty()
        self.done = 0
        self.label = ""
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker:
            self._ticker.join()
        self.clear()

    def update(self, done: int | None = None, label: str | None = None) -> None:
        with self._lock:
            if done is not None:
                self.done = done
            if label is not None:
                self.label = label
        self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        with self._lock:
            filled = int(self.width * self.done / max(1, self.total))
            bar = "#" * filled + "-" * (self.width - filled)
            text = f"[{bar}] {self.done}/{self.total} {self.label} ({time.monotonic() - self.started:.0f}s)"
            columns = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + text[: columns - 1].ljust(columns - 1))
            self.stream.flush()

    def clear(self) -> None:
        if self.enabled:
            columns = shutil.get_terminal_size((100, 20)).columns
            self.stream.write("\r" + " " * (columns - 1) + "\r")
            self.stream.flush()

    def print(self, line: str) -> None:
        """A line of output above the bar."""
        self.clear()
        print(line, flush=True)
        self.draw()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self.draw()


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
