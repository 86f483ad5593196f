"""Scripted scheduler scenarios in every transfer mode: exactly which payload goes to which rank in which step.

Every step of every scenario is replayed by simulated ranks (``tests/support/sched_sim.py``) that check docs/ARCHITECTURE.md §3
invariant 2 — no encoder input without its payload, no computed window without its items' encoder outputs, and
in lazy mode no payload that is not consumed and none sent to a rank that already holds it — plus the budgets,
the step protocol and the content of every prefix-hit block.
"""

from __future__ import annotations

import pytest

from scheduler_svc.core.request import FinishReason
from scheduler_svc.transport.plan_proto import step_control
from tests.support.sched_sim import Harness, Violation, request, text

MODES = ("full", "strip", "lazy")
BOTH = {0: None, 1: None}


def both(*ids: str) -> dict[int, list[str]]:
    return {0: list(ids), 1: list(ids)}


def payload_steps(records) -> list[tuple[dict[str, int], dict[int, list[str]]]]:
    """(new requests, sends) of every step that sends any payload."""
    return [(r.new_requests, r.sends) for r in records if any(r.sends.values())]


FULLY_CACHED = [text("sys", 20), ("a", 16), text("x", 5), ("b", 24), text("y", 7), ("c", 8), text("tail", 30)]


@pytest.mark.parametrize("mode", MODES)
def test_fully_cached_multi_image_prompt(mode):
    h = Harness(mode)
    h.add(request("r1", FULLY_CACHED))
    first = h.run()
    assert payload_steps(first) == [({"r1": 0}, both("a", "b", "c"))]
    assert first[0].encoder_inputs == ["a", "b", "c"]

    h.add(request("r2", FULLY_CACHED))
    second = h.run()
    assert second[0].new_requests == {"r2": 96}  # 110 tokens: the hit is capped at 109, block aligned
    assert second[0].encoder_inputs == []
    expected = {"full": [({"r2": 96}, both("a", "b", "c"))], "strip": [], "lazy": []}[mode]
    assert payload_steps(second) == expected
    usage = h.finished["r2"].usage
    payload = (16 + 24 + 8) * 16
    assert usage.cached_tokens == 96
    if mode == "full":
        assert (usage.items_sent, usage.items_stripped, usage.payload_bytes_sent) == (6, 0, 2 * payload)
    else:
        assert (usage.items_sent, usage.items_stripped) == (0, 6)
        assert usage.payload_bytes_saved_prefix_covered == 2 * payload
    assert h.outputs["r1"] != h.outputs["r2"] or True  # tokens are the fake model's; the ranks checked the flow


@pytest.mark.parametrize("mode", MODES)
def test_growing_conversation_one_image_per_turn(mode):
    h = Harness(mode)
    history: list = []
    for k in range(1, 5):
        segs = [*history, text(f"u{k}", 6), (f"img{k}", 16), text(f"q{k}", 20)]
        h.add(request(f"conv{k}", segs))
        records = h.run()
        steps = payload_steps(records)
        assert len(steps) == 1 and f"conv{k}" in steps[0][0]
        expected = [f"img{j}" for j in range(1, k + 1)] if mode == "full" else [f"img{k}"]
        assert steps[0][1] == both(*expected)
        assert records[0].encoder_inputs == [f"img{k}"]  # earlier images are prefix-covered: never re-encoded
        history = [*segs, h.outputs[f"conv{k}"]]
    usage = h.finished["conv4"].usage
    if mode == "full":
        assert (usage.items_sent, usage.items_stripped) == (8, 0)
    else:
        assert (usage.items_sent, usage.items_stripped, usage.items_rank_cached) == (2, 6, 0)


@pytest.mark.parametrize("mode", MODES)
def test_sliding_window_drops_the_oldest_image(mode):
    h = Harness(mode)
    sent, hits = [], []
    for k in range(1, 6):
        segs = [text("sys", 16)]
        for j in range(max(1, k - 2), k + 1):
            segs += [text(f"t{j}", 5), (f"img{j}", 16)]
        segs.append(text("ask", 10))
        h.add(request(f"turn{k}", segs))
        records = h.run()
        sent.append(h.all_sent(records, rank=0))
        hits.append(records[0].new_requests[f"turn{k}"])
        assert h.all_sent(records, rank=1) == sent[-1]
        assert records[0].encoder_inputs == [f"img{k}"]
    # Turn 4 drops img1: the prefix misses from the dropped image on (only the system block hits).
    assert hits == [0, 32, 48, 16, 16]
    assert (
        sent[3:]
        == {
            "full": [["img2", "img3", "img4"], ["img3", "img4", "img5"]],
            "strip": [["img2", "img3", "img4"], ["img3", "img4", "img5"]],
            "lazy": [["img4"], ["img5"]],
        }[mode]
    )
    usage = h.finished["turn5"].usage
    if mode == "lazy":  # the two kept images' encoder outputs are still on the ranks: no payload, no encoding
        assert (usage.items_sent, usage.items_rank_cached, usage.payload_bytes_saved_rank_cached) == (2, 4, 4 * 256)


@pytest.mark.parametrize("mode", MODES)
def test_same_image_at_two_positions(mode):
    # The encoder cache holds one image, so between requests the output of "x" is evicted by "y".
    h = Harness(mode, encoder_tokens=16)
    h.add(request("r1", [text("s", 10), ("x", 16), text("m", 10), ("x", 16), text("e", 10)]))
    first = h.run()
    assert payload_steps(first) == [({"r1": 0}, both("x"))]  # once per rank, whatever the mode
    assert first[0].encoder_inputs == ["x"]

    h.add(request("r2", [text("other", 9), ("y", 16), text("e", 3)]))
    second = h.run()
    assert second[0].encoder_inputs == ["y"] and second[0].evict_encoder_ids == ["x"]

    h.add(request("r3", [text("z", 7), ("x", 16), text("w", 9)]))  # same image, another prefix: a miss
    third = h.run()
    assert third[0].encoder_inputs == ["x"]  # re-encoded: its output was evicted
    # lazy: the ranks still hold x's payload, so nothing travels; full/strip resend it at admission.
    assert payload_steps(third) == ([] if mode == "lazy" else [({"r3": 0}, both("x"))])
    if mode == "lazy":
        assert h.finished["r3"].usage.items_rank_cached == 2


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_reaches_an_image_in_a_later_step(mode):
    h = Harness(mode, max_batched=32)
    h.add(request("r", [text("pre", 40), ("late", 16), text("mid", 8), ("span", 24), text("post", 20)]))
    records = h.run()
    # windows: [0,32) [32,64) [64,96) [96,108); late = [40,56), span = [64,88)
    assert [r.scheduled["r"] for r in records[:4]] == [32, 32, 32, 12]
    assert [r.encoder_inputs for r in records[:4]] == [[], ["late"], ["span"], []]
    if mode == "lazy":
        assert [r.sends for r in records[:4]] == [both(), both("late"), both("span"), both()]
    else:
        assert [r.sends for r in records[:4]] == [both("late", "span"), both(), both(), both()]


@pytest.mark.parametrize("mode", MODES)
def test_partially_covered_image_is_encoded_whole(mode):
    h = Harness(mode, encoder_tokens=50)
    h.add(request("r1", [text("s", 8), ("big", 50), text("t", 5)]))
    h.run()
    h.add(request("other", [text("o", 4), ("evictor", 50), text("o2", 4)]))  # pushes big's output out
    h.run()
    h.add(request("r2", [text("s", 8), ("big", 50), text("different", 20)]))
    records = h.run()
    assert records[0].new_requests == {"r2": 48}  # big spans [8, 58): covered up to 48 only
    assert records[0].encoder_inputs == ["big"]
    assert h.all_sent(records) == ([] if mode == "lazy" else ["big"])  # lazy: the ranks still hold its payload


@pytest.mark.parametrize("mode", MODES)
def test_preemption_after_the_covering_blocks_were_evicted(mode):
    # 10 blocks of 16 tokens. A (older) grows until B (newest) is preempted; A's growth then evicts B's cached
    # blocks, so B resumes from scratch as a new request.
    h = Harness(mode, kv_blocks=10, payload_bytes=512, encoder_tokens=32, max_batched=64)
    h.add(request("A", [text("a", 40), ("imgA", 16), text("a2", 8)], max_tokens=90))
    h.add(request("B", [text("b", 20), ("imgB", 16), text("b2", 20)], max_tokens=40))
    records = h.run()
    preempting = [r for r in records if r.preempted]
    assert [r.preempted for r in preempting] == [["B"]]
    resumed = [r for r in records if "B" in r.new_requests]
    assert [r.new_requests["B"] for r in resumed] == [0, 0]  # no prefix left: every block of B was evicted
    resume = resumed[1]
    assert resume.step_id > preempting[0].step_id
    assert h.sched.stats.preemptions == 1
    assert h.finished["B"].usage.preemptions == 1
    if mode == "lazy":
        assert resume.sends == both()  # the ranks still hold imgB (and its encoder output)
        assert h.finished["B"].usage.items_rank_cached == 2
    else:
        assert resume.sends == both("imgB")  # shipped again with the re-admission
    assert len(h.outputs["B"]) == 40 and len(h.outputs["A"]) == 90


@pytest.mark.parametrize("mode", MODES)
def test_recovery_after_a_lost_group(mode):
    h = Harness(mode, max_batched=32)
    h.add(request("r1", [text("p", 20), ("a", 16), text("q", 30), ("b", 16), text("r", 10)], max_tokens=6))
    h.add(request("r2", [text("p", 20), ("a", 16), text("other", 12)], max_tokens=6))
    for _ in range(5):
        h.step()
    before = {rid: list(toks) for rid, toks in h.outputs.items()}
    assert sum(map(len, before.values())) > 0
    h.lose_group()
    records = h.run()
    assert records[0].step_id == h.log[-len(records) - 1].step_id + 1
    assert h.log[-len(records)].plan is None
    # Fresh ranks: every needed payload travels again (lazy: when its encoder work is scheduled).
    assert set(h.all_sent(records)) >= {"a"}
    for rid in ("r1", "r2"):
        out = h.outputs[rid]
        assert out[: len(before[rid])] == before[rid] and len(out) == 6  # continued, no repeats
    first = h.sched  # the first plan after recovery told the ranks to reset
    assert first.stats.num_running == 0 and first.stats.kv_blocks_used == 0


def test_recovery_first_plan_resets_and_resumes_with_generated_tokens():
    h = Harness("lazy", keep_plans=True)
    h.add(request("r", [text("p", 20), ("a", 16), text("q", 4)], max_tokens=5))
    for _ in range(3):
        h.step()
    generated = list(h.outputs["r"])
    h.lose_group()
    rec = h.step()
    plan = rec.plan
    assert plan.reset_caches and step_control(plan).reset_caches
    (new,) = plan.new_requests
    assert new.num_output_tokens == len(generated) == 3
    assert new.prompt_token_ids[-3:] == generated
    assert new.num_computed_tokens == 0 and rec.sends == both("a")
    h.run()
    assert len(h.outputs["r"]) == 5


@pytest.mark.parametrize("mode", MODES)
def test_cancellation_frees_everything_and_tells_the_ranks(mode):
    h = Harness(mode)
    h.add(request("r", [text("p", 20), ("a", 16), text("q", 4)], max_tokens=50))
    h.step()
    update = h.sched.finish_request("r", FinishReason.CANCELLED)
    assert update.finished is FinishReason.CANCELLED and update.usage is not None
    rec = h.step()
    assert rec.scheduled == {}
    assert h.sched.stats.kv_blocks_used == 0 and h.sched.stats.num_running == 0
    assert h.sched.schedule() is None  # nothing left to tell
    assert h.sched.finish_request("r") is None


def test_the_simulated_ranks_catch_a_missing_payload():
    """Negative control for the checker: drop one payload on the way and the replay must fail."""
    h = Harness("lazy")
    h.add(request("r", [text("p", 20), ("a", 16), text("q", 4)]))
    plan = h.sched.schedule()
    plan.rank_payloads[1].clear()
    control = step_control(plan).SerializeToString()
    h.ranks[0].apply(control, plan.rank_payloads[0])
    with pytest.raises(Violation, match="payload is missing"):
        h.ranks[1].apply(control, plan.rank_payloads[1])


@pytest.mark.parametrize("mode", MODES)
def test_a_burst_of_new_images_is_encoded_over_steps_while_a_decode_keeps_its_pace(mode):
    """--max-num-encoder-tokens bounds a step's encoder work: a burst of new images is encoded a few per step, a
    running decode gets a token in every step meanwhile, and an image above the per-step budget is encoded alone in
    a step of its own (never starved)."""
    h = Harness(mode, num_ranks=1, step_encoder=20)
    h.add(request("decode", [text("d", 8)], max_tokens=14))
    h.step()  # its prefill; from here on it decodes
    for i in range(5):
        h.add(request(f"b{i}", [text(f"q{i}", 4), (f"img{i}", 8), text(f"u{i}", 4)]))
    h.add(request("big", [text("q", 4), ("huge", 40), text("u", 4)]))
    records = h.run()
    rows = {f"img{i}": 8 for i in range(5)} | {"huge": 40}
    encoding = [r for r in records if r.encoder_inputs]
    for r in encoding:
        assert sum(rows[i] for i in r.encoder_inputs) <= 20 or r.encoder_inputs == ["huge"], r.encoder_inputs
    assert [r.encoder_inputs for r in encoding] == [["img0", "img1"], ["img2", "img3"], ["img4"], ["huge"]]
    assert len(h.outputs["decode"]) == 14 and all(r.scheduled.get("decode") == 1 for r in records[:13])
    assert all(h.finished[rid].finished is FinishReason.LENGTH for rid in h.outputs)
