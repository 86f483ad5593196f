"""Randomised sessions against the simulated ranks: small pools and caches, shared images and prefixes, chunked
prefill, preemptions, cancellations and group losses, in every transfer mode.

The replay checks invariant 2 at every step (see ``tests/support/sched_sim.py``); the end of a session checks that every
request produced exactly the tokens of an uninterrupted run (no repeats, no gaps) and that nothing is left held.
"""

from __future__ import annotations

import random

import pytest

from common.errors import ResourceExhausted
from scheduler_svc.core.request import FinishReason
from tests.support.sched_sim import Harness, request, sample_token, text

IMAGES = {f"img{k}": length for k, length in enumerate((8, 12, 16, 20, 24, 10, 14))}
TEXTS = ("alpha", "beta", "gamma", "delta", "eps")


def random_prompt(rng: random.Random, prefixes: list) -> list:
    segs = list(rng.choice(prefixes)) if prefixes and rng.random() < 0.5 else []
    for _ in range(rng.randint(1, 4)):
        segs.append(text(rng.choice(TEXTS), rng.randint(1, 20)))
        if rng.random() < 0.7:
            name = rng.choice(sorted(IMAGES))
            segs.append((name, IMAGES[name]))
    segs.append(text("end", rng.randint(1, 6)))
    return segs


BOUNDED: list[int] = []  # step ids the stall bound cut, as the simulated ranks saw them


def linear_timing(plan) -> tuple[float, float]:
    """The simulated ranks' clocks for the stall bound: 5 ms a step, 0.5 ms a prefill token, 1 ms an encoder row."""
    if plan.stall_bounded:
        BOUNDED.append(plan.step_id)
    encoder = 0.001 * plan.work.encoder_rows
    return 0.005 + 0.0005 * plan.work.prefill_tokens + encoder, encoder


def run_session(mode: str, seed: int, placement: str = "replicated", stall: bool = False) -> Harness:
    rng = random.Random(seed)
    h = Harness(
        mode,
        placement=placement,
        num_ranks=rng.choice([1, 2, 3]),
        kv_blocks=rng.randint(14, 40),
        encoder_tokens=rng.choice([24, 40, 64, 400]),
        payload_bytes=rng.choice([400, 800, 2000, 1 << 20]),
        max_batched=rng.choice([8, 16, 33, 64, 512]),
        max_seqs=rng.choice([1, 2, 3, 8]),
        max_stall_ms=rng.choice([1.0, 10.0, 30.0]) if stall else 0.0,
        timing=linear_timing if stall else None,
    )
    prefixes: list = []
    cancelled: set[str] = set()
    lengths: dict[str, int] = {}
    for i in range(rng.randint(40, 120)):
        if rng.random() < 0.3:
            segs = random_prompt(rng, prefixes)
            rid = f"s{seed}-r{i}"
            try:
                req = h.add(request(rid, segs, max_tokens=rng.randint(1, 12), salt=rng.choice([None, None, "t"])))
            except ResourceExhausted:
                pass  # larger than this group's pools or payload cache: refused up front, by design
            else:
                prefixes.append(segs)
                lengths[rid] = req.num_prompt_tokens
        if rng.random() < 0.04 and h.sched.has_requests():
            rid = rng.choice(sorted(lengths))
            if h.sched.finish_request(rid, FinishReason.CANCELLED) is not None:
                cancelled.add(rid)
        if rng.random() < 0.02:
            h.lose_group()
        h.step()
    h.run()
    for rid, prompt_len in lengths.items():
        if rid in cancelled:
            continue
        want = [sample_token(rid, prompt_len + k) for k in range(h.max_tokens[rid])]
        assert h.outputs[rid] == want, rid
    stats = h.sched.stats
    assert (stats.num_running, stats.num_waiting, stats.kv_blocks_used) == (0, 0, 0)
    return h


@pytest.mark.parametrize(
    ("mode", "placement", "sessions"),
    [
        ("full", "replicated", 120),
        ("strip", "replicated", 120),
        ("lazy", "replicated", 120),
        ("full", "sharded", 60),
        ("strip", "sharded", 60),
        ("lazy", "sharded", 120),
    ],
)
def test_random_sessions_keep_every_invariant(mode, placement, sessions):
    """Sharded placement: only each encoder input's owner must hold its payload (the simulated ranks check it)."""
    preemptions = recoveries = 0
    for seed in range(sessions):
        h = run_session(mode, seed, placement)
        preemptions += h.sched.stats.preemptions
        recoveries += h.recoveries
    assert preemptions > 0 and recoveries > 0  # the sessions did exercise both


@pytest.mark.parametrize(("mode", "placement"), [("full", "replicated"), ("lazy", "sharded")])
def test_random_sessions_under_the_stall_bound_keep_every_invariant(mode, placement):
    """The stall bound (step_costs.py) cuts windows anywhere, a step's first one never below a block: the same
    invariants and the same tokens."""
    BOUNDED.clear()
    for seed in range(60):
        run_session(mode, seed, placement, stall=True)
    assert len(BOUNDED) > 100  # the sessions did cut steps
