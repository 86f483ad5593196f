"""Counters count what travelled (scheduler_svc/core/transfer.py's module doc), in every transfer mode.

Every plan is replayed by the simulated ranks of ``tests/support/sched_sim.py``; the payloads each plan really queues for each
rank (``rank_payloads``, what the group writes) are the reference the counters must equal — per step, and summed
over the requests' Usage. "Saved" is checked against the deliveries ``full`` would have made: one per item and
rank for the items of the requests admitted in a step.
"""

from __future__ import annotations

import pytest

from scheduler_svc.core.request import FinishReason
from scheduler_svc.transport.plan_proto import step_control
from tests.support.sched_sim import ROW_BYTES, Harness, request, text

MODES = ("full", "strip", "lazy")


def written(plan) -> tuple[int, int]:
    """(deliveries, payload bytes) the plan really queues, over ranks."""
    sends = [s for per_rank in plan.rank_payloads for s in per_rank]
    return len(sends), sum(s.nbytes for s in sends)


def due(plan, ranks: int) -> tuple[int, int]:
    """(deliveries, bytes) ``full`` would write for the plan's admissions: every distinct item once per rank."""
    items = {
        m.item_identifier if hasattr(m, "item_identifier") else m.identifier: m
        for nr in plan.new_requests
        for m in nr.mm_items
    }
    return ranks * len(items), ranks * sum(m.payload_nbytes for m in items.values())


def check_wire(h: Harness, usages) -> None:
    """Per step and in total, the counters equal what the plans queued; the Usages add up to the same."""
    plans = [r.plan for r in h.log]
    for plan in plans:
        totals = plan.totals()
        assert (totals.sent, totals.payload_bytes_sent) == written(plan), f"step {plan.step_id}"
    wire = tuple(map(sum, zip(*(written(p) for p in plans), strict=True)))
    assert (sum(u.items_sent for u in usages), sum(u.payload_bytes_sent for u in usages)) == wire


def check_dues(h: Harness, usages, abandoned_bytes: int = 0) -> None:
    """Without re-sends or preemptions, every delivery ``full`` would make is settled exactly once."""
    plans = [r.plan for r in h.log]
    items, nbytes = map(sum, zip(*(due(p, h.group.num_ranks) for p in plans), strict=True))
    settled = sum(
        u.items_sent + u.items_stripped + u.items_rank_cached + u.items_abandoned + u.items_encoder_shared
        for u in usages
    )
    saved = sum(
        u.payload_bytes_sent
        + u.payload_bytes_saved_prefix_covered
        + u.payload_bytes_saved_rank_cached
        + u.payload_bytes_saved_encoder_shared
        for u in usages
    )
    assert (settled, saved + abandoned_bytes) == (items, nbytes)


def usages(h: Harness, *rids: str):
    return [h.finished[rid].usage for rid in rids]


@pytest.mark.parametrize("mode", MODES)
def test_an_image_repeated_in_a_prompt_counts_once_per_rank(mode):
    h = Harness(mode, keep_plans=True)
    h.add(request("r", [text("s", 10), ("x", 16), text("m", 10), ("x", 16), text("n", 3), ("y", 32), text("e", 5)]))
    h.run()
    (u,) = usages(h, "r")
    assert (u.items_sent, u.payload_bytes_sent) == (2 * 2, 2 * (16 + 32) * ROW_BYTES)
    assert (u.items_stripped, u.items_rank_cached, u.payload_bytes_saved_rank_cached) == (0, 0, 0)
    check_wire(h, [u])
    check_dues(h, [u])


@pytest.mark.parametrize("mode", MODES)
def test_an_image_shared_by_requests_admitted_together_is_charged_to_the_first(mode):
    h = Harness(mode, keep_plans=True)
    h.add(request("r1", [text("a", 10), ("x", 16), text("b", 6)]))
    h.add(request("r2", [text("c", 7), ("x", 16), text("d", 4), ("y", 16), text("e", 5)]))
    records = h.run()
    assert records[0].new_requests.keys() == {"r1", "r2"}  # one admission step
    u1, u2 = usages(h, "r1", "r2")
    payload = 16 * ROW_BYTES
    assert (u1.items_sent, u1.payload_bytes_sent) == (2, 2 * payload)  # x: the first request that needed it
    assert (u2.items_sent, u2.payload_bytes_sent) == (2, 2 * payload)  # y only: x travelled once
    assert u2.items_rank_cached == u2.payload_bytes_saved_rank_cached == 0  # lazy: its due was r1's to settle
    check_wire(h, [u1, u2])
    check_dues(h, [u1, u2])


@pytest.mark.parametrize("mode", MODES)
def test_a_covered_image_shared_by_requests_admitted_together_is_saved_once(mode):
    h = Harness(mode, keep_plans=True)
    base = [text("sys", 20), ("x", 16), text("q", 28)]  # x ends at 36, covered by a 48-token hit
    h.add(request("r0", [*base, text("t0", 4)]))
    h.run()
    h.log.clear()
    h.add(request("r1", [*base, text("t1", 4)]))
    h.add(request("r2", [*base, text("t2", 4)]))
    h.add(request("r3", [text("other", 9), ("x", 16), text("t3", 4)]))  # x uncovered: it must travel
    records = h.run()
    assert records[0].new_requests == {"r1": 64, "r2": 64, "r3": 0}
    u1, u2, u3 = usages(h, "r1", "r2", "r3")
    payload = 16 * ROW_BYTES
    assert u1.items_sent == u2.items_sent == 0 or mode == "full"
    # Nothing is prefix-covered in this step: r3 needed x. One delivery per rank, by whichever request first
    # needed it (full: r1, which needs every item); lazy: the ranks still hold x from r0, so nothing travels.
    expected = {"full": (0, 0, 0), "strip": (2, 2 * payload, 0), "lazy": (0, 0, 2)}[mode]
    assert (u3.items_sent, u3.payload_bytes_sent, u3.items_rank_cached) == expected
    assert sum(u.items_stripped for u in (u1, u2, u3)) == 0
    check_wire(h, [u1, u2, u3])
    check_dues(h, [u1, u2, u3])

    h.log.clear()
    h.add(request("r4", [*base, text("t4", 4)]))
    h.add(request("r5", [*base, text("t5", 4)]))
    h.run()
    u4, u5 = usages(h, "r4", "r5")
    if mode == "full":
        assert (u4.items_sent, u5.items_sent, u4.items_stripped + u5.items_stripped) == (2, 0, 0)
    else:  # covered for both: saved once per rank, charged to the first
        assert (u4.items_stripped, u4.payload_bytes_saved_prefix_covered) == (2, 2 * payload)
        assert (u5.items_stripped, u5.payload_bytes_saved_prefix_covered, u4.items_sent + u5.items_sent) == (0, 0, 0)
    check_wire(h, [u4, u5])
    check_dues(h, [u4, u5])


def test_lazy_abandoned_counts_only_items_of_requests_that_ended():
    h = Harness("lazy", keep_plans=True, max_batched=32)
    h.add(request("r", [text("p", 20), ("a", 16), text("q", 40), ("b", 16), text("e", 4)], max_tokens=5))
    h.step()  # [0, 32): a encoded; b not reached
    update = h.sched.finish_request("r", FinishReason.CANCELLED)
    assert update.usage.items_abandoned == 2  # b, once per rank
    rec = h.step()  # the plan that tells the ranks also carries the count for the metrics
    assert rec.plan.totals().abandoned == 2 and rec.plan.accounting == {}
    check_wire(h, [update.usage])
    check_dues(h, [update.usage], abandoned_bytes=2 * 16 * ROW_BYTES)


def test_lazy_a_preempted_request_abandons_nothing():
    # 10 blocks of 16 tokens: A grows until B, prefilled in chunks, is preempted before reaching its image.
    h = Harness("lazy", kv_blocks=10, payload_bytes=4096, encoder_tokens=64, max_batched=24, keep_plans=True)
    h.add(request("A", [text("a", 40), ("imgA", 16), text("a2", 8)], max_tokens=70))
    h.add(request("B", [text("b", 120), ("imgB", 16), text("b2", 4)], max_tokens=4))
    h.run()
    preempting = [r for r in h.log if r.preempted]
    assert preempting and preempting[0].preempted == ["B"]
    before = [r for r in h.log if r.step_id < preempting[0].step_id]
    assert "imgB" not in [key for r in before for key in r.encoder_inputs]  # B had not reached imgB
    u = h.finished["B"].usage
    assert u.preemptions >= 1 and u.items_abandoned == 0
    assert sum(r.plan.totals().abandoned for r in h.log) == 0
    check_wire(h, usages(h, "A", "B"))


def test_strip_serves_cached_x_plus_new_y_when_only_y_fits():
    # A rank's payload cache holds one 640-byte image. X is cached by the prefix, Y is new: only Y travels.
    h = Harness("strip", payload_bytes=1000, keep_plans=True)
    base = [text("sys", 20), ("X", 40), text("q", 20)]  # X ends at 60; a 64-token hit covers it
    h.add(request("r1", [*base, text("t", 4)]))
    h.run()
    h.log.clear()
    h.add(request("r2", [*base, text("more", 10), ("Y", 40), text("e", 4)]))
    records = h.run()
    assert records[0].new_requests == {"r2": 80}
    assert records[0].sends == {0: ["Y"], 1: ["Y"]}  # at admission, as strip does
    u = h.finished["r2"].usage
    assert (u.items_sent, u.items_stripped) == (2, 2)
    check_wire(h, [u])
    check_dues(h, [u])


def test_strip_defers_what_cannot_travel_at_once():
    # Two new 640-byte images and a 1000-byte payload cache: sent at admission they would never fit, so they
    # are deferred (the guarantee that a request which lost its prefix is still served) and sent with encoding.
    h = Harness("strip", payload_bytes=1000, max_batched=48, keep_plans=True)
    h.add(request("r", [text("t", 4), ("a", 40), text("u", 2), ("b", 40), text("v", 2)]))
    records = h.run()
    assert [r.sends[0] for r in records if r.sends[0]] == [["a"], ["b"]]
    assert [r.encoder_inputs for r in records if r.encoder_inputs] == [["a"], ["b"]]
    (u,) = usages(h, "r")
    check_wire(h, [u])
    check_dues(h, [u])


@pytest.mark.parametrize("mode", MODES)
def test_sharded_placement_sends_each_new_item_once_to_one_owner(mode):
    """One delivery and one encoder run per item for the whole group; the other ranks' deliveries are settled as
    encoder_shared (their output comes over the collective); owners are balanced by encoder rows."""
    h = Harness(mode, num_ranks=3, keep_plans=True, placement="sharded")
    h.add(request("r", [text("s", 10), ("x", 16), text("m", 10), ("x", 16), text("n", 3), ("y", 32), text("e", 5)]))
    records = h.run()
    (u,) = usages(h, "r")
    assert (u.items_sent, u.payload_bytes_sent) == (2, (16 + 32) * ROW_BYTES)
    assert (u.items_encoder_shared, u.payload_bytes_saved_encoder_shared) == (2 * 2, 2 * (16 + 32) * ROW_BYTES)
    assert u.encoder_runs == 2
    sends = {rank: ids for rec in records for rank, ids in rec.sends.items() if ids}
    assert sorted(sends.values()) == [["x"], ["y"]] and len(sends) == 2  # two different owners
    owners = [e.owner_rank for rec in records for e in step_control(rec.plan).encoder_inputs]
    assert sorted(owners) == sorted(sends) and not any(
        e.replicated for rec in records for e in step_control(rec.plan).encoder_inputs
    )
    check_wire(h, [u])
    check_dues(h, [u])
