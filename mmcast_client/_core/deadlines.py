"""The deadlines of one operation: its whole duration and, for a generation, its first token."""

from __future__ import annotations

import time

from mmcast_client.errors import DeadlineExceeded


class Deadline:
    """The deadlines of one operation: its whole duration and, for a generation, its first token; each absolute
    (time.monotonic()) or None, measured from `start` (default: now)."""

    def __init__(
        self, timeout: float | None, first_token_timeout: float | None = None, start: float | None = None
    ) -> None:
        start = time.monotonic() if start is None else start
        self.timeout = timeout
        self.first_token_timeout = first_token_timeout
        self.at = None if timeout is None else start + timeout
        self.first_token_at = None if first_token_timeout is None else start + first_token_timeout

    def remaining(self, before_first_token: bool = True) -> float | None:
        """Seconds left (None: unbounded); raises DeadlineExceeded when none are."""
        now = time.monotonic()
        first_token_at = self.first_token_at if before_first_token else None
        if first_token_at is not None and first_token_at <= now:
            raise first_token_deadline_error(self.first_token_timeout)
        if self.at is not None and self.at <= now:
            raise DeadlineExceeded(
                message=f"the deadline of {self.timeout:.3f} s passed; raise timeout= if the server needs longer, "
                "or pass timeout=None"
            )
        left = [t - now for t in (self.at, first_token_at) if t is not None]
        return min(left) if left else None

    def first_token_wait(self) -> float | None:
        """Seconds until the first token is due (None: no such deadline)."""
        return None if self.first_token_at is None else max(0.0, self.first_token_at - time.monotonic())

    def bounded(self, timeout: float | None) -> Deadline:
        """The deadline of one unary call inside this operation (an upload before the first token): `timeout` from
        now, or this operation's deadlines, whichever comes first."""
        inner = Deadline(timeout, None)
        inner.first_token_at, inner.first_token_timeout = self.first_token_at, self.first_token_timeout
        if self.at is not None and (inner.at is None or self.at < inner.at):
            inner.at, inner.timeout = self.at, self.timeout
        return inner


def first_token_deadline_error(first_token_timeout: float | None) -> DeadlineExceeded:
    return DeadlineExceeded(
        message=f"no token arrived within first_token_timeout={first_token_timeout} s (uploads, retries and "
        "queueing included); raise first_token_timeout= (per call or on the client), or pass None for no limit"
    )
