"""A 10,000-item session: per-step work stays bounded by the step's window (a count, not a timing).

One request carries 10,000 small images (4 placeholder tokens each, 2 text tokens between), so its prompt is
~60k tokens, prefilled in 512-token chunks and then decoded. The step builder must examine every item once at
admission (the metadata of every item travels with a new request) and afterwards only the items overlapping each
step's window: ~86 per prefill chunk, none while decoding — never the 10,000. A second request admitted mid-way
shows that a long-running request's items cost nothing to the steps of others.

Step timings are printed (``pytest -s``) for the record; only the counts are asserted.
"""

from __future__ import annotations

import statistics
import time

import pytest

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.core.inputs import GroupBudget
from scheduler_svc.core.request import Request, RequestSampling
from scheduler_svc.core.scheduler import Scheduler
from tests.support.sched_sim import IMG, Harness, feature, outcome, request, sample_token, text

NUM_ITEMS = 10_000
ITEM_TOKENS = 4
GAP = 2
CHUNK = 512


def big_request(rid: str = "big", max_tokens: int = 16) -> Request:
    tokens: list[int] = []
    features = []
    for k in range(NUM_ITEMS):
        tokens += [7, 8][:GAP]
        features.append(feature(f"item-{k}", len(tokens), ITEM_TOKENS))
        tokens += [IMG] * ITEM_TOKENS
    tokens += [9] * 5
    return Request(rid, tokens, features, RequestSampling(max_tokens=max_tokens, ignore_eos=True))


def drive(sched: Scheduler, on_step=None) -> list[tuple[int, float, float, dict]]:
    """Runs to idle with a trivial rank 0; returns (items_examined, schedule s, update s, scheduled) per step."""
    out = []
    while True:
        t0 = time.perf_counter()
        plan = sched.schedule()
        t1 = time.perf_counter()
        if plan is None:
            return out
        sampled = {rid: sample_token(rid, sched.get_request(rid).num_tokens) for rid in plan.sampling_request_ids}
        t2 = time.perf_counter()
        sched.update_from_output(plan, outcome(sampled))
        t3 = time.perf_counter()
        out.append((plan.items_examined, t1 - t0, t3 - t2, dict(plan.num_scheduled_tokens)))
        if on_step:
            on_step(len(out), sched)


def window_bound() -> int:
    """Items a CHUNK-token window can overlap, plus the one the scan stops at."""
    return CHUNK // (ITEM_TOKENS + GAP) + 2


@pytest.mark.parametrize("mode", ("full", "strip", "lazy"))
def test_items_examined_stay_bounded_by_the_window(mode, capsys):
    config = SchedulerConfig(transfer_mode=mode, max_num_batched_tokens=CHUNK, max_model_len=70_000)
    sched = Scheduler(config, GroupBudget(2, 4400, 4096, 4 << 20), uses_mrope=True, eos_token_ids=set())
    sched.add_request(big_request())

    def add_second(step, s):
        if step == 40:  # mid-prefill of the big request
            s.add_request(Request("small", [1, 2, 3] * 10, [], RequestSampling(max_tokens=4, ignore_eos=True)))

    steps = drive(sched, add_second)
    examined = [e for e, *_ in steps]
    admission, rest = examined[0], examined[1:]
    assert NUM_ITEMS <= admission <= NUM_ITEMS + window_bound()
    assert max(rest) <= window_bound()  # never the whole list again
    prefill = [e for e, _, _, sched_tokens in steps[1:] if sched_tokens.get("big", 0) > 1]
    decode = [e for e, _, _, sched_tokens in steps[1:] if sched_tokens.get("big") == 1]
    assert len(prefill) > 100 and min(prefill) > 0
    assert len(decode) == 15 and set(decode) == {0}
    assert sched.stats.num_running == 0 and sched.stats.kv_blocks_used == 0

    sched_s = [s for _, s, _, _ in steps]
    update_s = [u for _, _, u, _ in steps]
    with capsys.disabled():
        print(
            f"\n[{mode}] 10,000-item session: {len(steps)} steps; items examined: admission {admission}, "
            f"max later {max(rest)}, decode {max(decode)}; schedule(): admission {sched_s[0] * 1e3:.1f} ms, "
            f"prefill median {statistics.median(sched_s[1 : len(prefill)]) * 1e3:.3f} ms / max "
            f"{max(sched_s[1:]) * 1e3:.3f} ms, decode median "
            f"{statistics.median(sched_s[-len(decode) :]) * 1e3:.3f} ms; update_from_output median "
            f"{statistics.median(update_s) * 1e3:.3f} ms"
        )


def test_ten_thousand_items_replayed_by_the_checking_ranks():
    """The same session through the simulated ranks in lazy mode: every item's payload arrives exactly in the step
    that encodes it, and nothing else travels."""
    h = Harness(
        "lazy", kv_blocks=4400, encoder_tokens=4096, payload_bytes=4 << 20, max_batched=CHUNK, max_model_len=70_000
    )
    h.add(big_request(max_tokens=2))
    h.add(request("other", [text("x", 10), ("item-5", ITEM_TOKENS), text("y", 3)], max_tokens=2))
    records = h.run()
    sent = h.all_sent(records)
    assert len(sent) == NUM_ITEMS and set(sent) == {f"item-{k}" for k in range(NUM_ITEMS)}
    assert max(r.items_examined for r in records[1:]) <= window_bound() + 1
