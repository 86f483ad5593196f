"""Load against a real local deployment (LocalGroup: scheduler + TP=2 worker processes), every answer checked
against the transformers oracle, every process's RSS sampled against a bound derived from its flags.

The driver (``Workload``, ``run_load``) lives in ``tests/support/load.py``: ``tests/faults/test_e2e.py`` runs a short load on its group in
``make test``; ``test_soak_long`` here runs for ``MMCAST_SOAK_SECONDS`` (default 600) in ``make soak``, with small
caches so that LRU eviction and preemption happen, and kills a worker rank every ``MMCAST_SOAK_KILL_EVERY``
seconds (default 180; 0 = never): the recovery must stay invisible to the clients. Set ``MMCAST_SOAK_REPORT`` to a
path to get the figures as JSON (docs/RELIABILITY.md quotes them).
"""

from __future__ import annotations

import os

import pytest

from mmcast_local.supervisor import LocalGroup
from tests.support.load import (
    Budgets,
    MiB,
    Workload,
    check_load,
    rss_of,
    run_load,
    write_report,
)
from tests.support.oracle import Oracle, scrape

# -- the long soak (make soak) ----------------------------------------------------------------------------------------
SOAK_BUDGETS = Budgets(
    processor_cache_bytes=16 * MiB,
    upload_store_bytes=8 * MiB,
    kv_blocks=192,  # ~7 blocks a request: 48 clients do not all fit, so requests are preempted and resumed
    payload_cache_bytes=8 * MiB,  # ~28 images of 112x112: the lazy payload cache evicts
    encoder_cache_tokens=640,  # ~40 images: the encoder cache evicts
)


@pytest.mark.soak
@pytest.mark.slow
def test_soak_long(tiny_model_dir, tmp_path):
    seconds = float(os.environ.get("MMCAST_SOAK_SECONDS", "600"))
    kill_every = float(os.environ.get("MMCAST_SOAK_KILL_EVERY", "180"))
    clients = int(os.environ.get("MMCAST_SOAK_CLIENTS", "48"))
    oracle = Oracle(tiny_model_dir)
    group = LocalGroup(
        tiny_model_dir,
        2,
        "lazy",
        kv_blocks=SOAK_BUDGETS.kv_blocks,
        scheduler_args=[*SOAK_BUDGETS.scheduler_args(), "--group-deadline-seconds", "120"],
        worker_args=[*SOAK_BUDGETS.worker_args(), "--group-timeout-seconds", "20"],
        log_dir=tmp_path / "logs",
        max_restarts=1000,
        ready_timeout=300,
    )
    group.start()
    try:
        workload = Workload(oracle, seed=7, n_base=8, n_fresh=int(seconds), max_tokens=8)
        group.wait_ready()
        baseline = rss_of(group)
        bound = SOAK_BUDGETS.bounds(baseline, oracle.model.config, tp=2)
        report = run_load(
            group,
            workload,
            clients=clients,
            seconds=seconds,
            rss_bound=bound,
            rss_baseline=baseline,
            p_fresh=0.05,
            seed=7,
            kill_every=kill_every,
        )
        recoveries = scrape(group.metrics_urls["scheduler"], "mmcast_worker_group_recoveries_total")
        preempted = scrape(group.metrics_urls["scheduler"], "mmcast_preemptions_total")
        write_report("soak", report, {"group_recoveries": recoveries, "preemptions_total": preempted})
        check_load(report)
        assert report.kills == 0 or recoveries >= 1
    finally:
        group.stop()
