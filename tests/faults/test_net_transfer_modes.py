"""The network faults where the transfer differs: the ``full`` transfer mode with ``pixels`` payloads (every
payload at admission, to every rank, as float32 pixel values: 22.5 MB per 1280x720 image and rank) instead of the
``lazy``/``encoded`` deployment of test_net_partitions.py (the file once, to its owner rank). Same checks; long
runs only (make chaos).
"""

from __future__ import annotations

import os
import time

import pytest

from tests.faults.test_net_partitions import BUDGETS, TP, Env, _for, lab, run_fault, slow_link
from tests.support.load import rss_of
from tests.support.net_group import NetGroup
from tests.support.oracle import Oracle

pytestmark = [pytest.mark.slow, pytest.mark.chaos]
__all__ = ["lab"]  # the namespaces fixture, shared with test_net_partitions.py

STEP_TIMEOUT = 10.0  # --step-timeout-seconds


@pytest.fixture(scope="module")
def env(lab, tiny_model_dir, tmp_path_factory):
    group = NetGroup(
        lab,
        tiny_model_dir,
        TP,
        "full",
        kv_blocks=BUDGETS.kv_blocks,
        scheduler_args=[
            *BUDGETS.scheduler_args(),
            "--payload-encoding",
            "pixels",
            "--step-timeout-seconds",
            str(STEP_TIMEOUT),
            "--keepalive-seconds",
            "2",
            "--group-deadline-seconds",
            "60",
            "--reconnect-backoff-max-seconds",
            "0.5",
        ],  # fmt: skip
        worker_args=[*BUDGETS.worker_args(), "--group-timeout-seconds", "10"],
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),
        log_dir=tmp_path_factory.mktemp("netfault-full-logs"),
        ready_timeout=240,
        max_restarts=20,
    )
    group.start()
    try:
        oracle = Oracle(tiny_model_dir)
        group.wait_ready()
        yield Env(lab, group, oracle, rss_of(group))
    finally:
        group.stop()


def test_one_way_partition_below_the_step_deadline_full_pixels(env):
    """As in the lazy deployment: the scheduler's packets to rank 1 lost for 2 s; here every new image's pixels
    go to both ranks at admission. Every stream completes equal to the oracle, no recovery."""
    streams = env.traffic()
    figures = run_fault(
        env, "partition_sched_rank1_2s_one_way_full_pixels", lambda: _for(2.0, env.lab.drop, env.sched, env.rank1),
        streams=streams,
    )  # fmt: skip
    assert not figures["failures"], figures["failures"]
    env.check_after(streams, "2 s one-way partition (full, pixels)")


def test_a_1_mbit_scheduler_link_while_pixels_of_a_new_1280x720_image_travel(env):
    """1 Mbit/s on what the scheduler sends while a new 1280x720 image goes to both ranks as pixels (2 x 22.5 MB:
    six minutes at that rate): the step's writes outlast the step deadline, the group is lost at the deadline
    (not when the link recovers), the request fails naming --step-timeout-seconds once poison isolation has
    tried it alone, and once the link is back the same image is answered equal to the oracle."""
    t0 = time.monotonic()
    figures = slow_link(env, "rate_1mbit_sched_out_new_1280x720_pixels_full", env.sched, "out", n=1)
    assert figures["recoveries"] >= 1
    assert time.monotonic() - t0 < 8 * STEP_TIMEOUT + 60, "the slow link held the step past its deadlines"
