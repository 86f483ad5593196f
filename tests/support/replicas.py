"""Several local replicas (a scheduler and its TP=1 group each) started together, for the multi-replica tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from mmcast_local.supervisor import LocalGroup


@contextlib.contextmanager
def replicas(model_dir, count: int, **group_kw) -> Iterator[list[LocalGroup]]:
    """``count`` TP=1 lazy groups, all started before any is waited for (their start-ups overlap), all stopped
    at the end whatever happened."""
    started = [LocalGroup(model_dir, 1, "lazy", **group_kw).start() for _ in range(count)]
    try:
        for g in started:
            g.wait_ready()
        yield started
    finally:
        for g in started:
            g.stop()
