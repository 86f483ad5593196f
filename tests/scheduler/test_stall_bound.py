"""The stall bound (``scheduler_svc/core/step_costs.py``, ``--max-decode-stall-ms``): while requests decode, a step's
prefill and encoder work is cut to what the measured costs say fits the target; with nothing decoding the size
budgets alone apply; every step still makes progress. The simulated ranks report step times from a fixed linear
cost model of each plan, so every decision here is deterministic."""

from __future__ import annotations

import pytest

from scheduler_svc.core.request import Request, RequestSampling
from scheduler_svc.core.step_costs import StepCosts, least_end
from scheduler_svc.core.step_plan import StepWork
from scheduler_svc.core.windows import Window
from tests.support.sched_sim import Harness, build, request, text

DECODE_S = 0.010  # a step of decodes alone
TOKEN_S = 0.0001  # per prefill token
ROW_S = 0.0004  # per encoder-output row (an image of 64 rows: 25.6 ms)
ROWS = 64


def timing(plan) -> tuple[float, float]:
    """The ranks' clocks under the linear cost model: (step seconds, encoder seconds)."""
    encoder = ROW_S * plan.work.encoder_rows
    return DECODE_S + TOKEN_S * plan.work.prefill_tokens + encoder, encoder


def harness(stall_ms: float, **kw) -> Harness:
    kw.setdefault("encoder_tokens", 4096)
    return Harness("lazy", max_stall_ms=stall_ms, timing=timing, keep_plans=True, **kw)


def image_request(k: int, max_tokens: int = 2) -> Request:
    return request(f"img{k}", [text(f"q{k}", 8), (f"new{k}", ROWS), text(f"t{k}", 8)], max_tokens=max_tokens)


def decoding(h: Harness, n: int = 2, max_tokens: int = 60) -> None:
    """``n`` text requests decoding, and the costs of a prefill, an encoder run and a decode step measured."""
    for k in range(n):
        h.add(request(f"dec{k}", [text(f"d{k}", 20)], max_tokens=max_tokens))
    h.step()
    h.step()  # a step of decodes alone: the base the prefill rate is measured above
    h.add(request("warm", [text("w", 8), ("warm-img", ROWS), text("w2", 8)], max_tokens=1))
    h.step()
    assert all(rate is not None for rate in h.sched.costs.estimates().values())
    assert all(h.sched.get_request(f"dec{k}").num_output_tokens > 0 for k in range(n))


def decode_steps(h: Harness, first: int):
    """The plans from record ``first`` on whose step a decode was in (a request with output tokens)."""
    return [r.plan for r in h.log[first:] if any(rid.startswith("dec") for rid in r.scheduled)]


def stall_s(plan) -> float:
    return timing(plan)[0]


# --- the rates ---------------------------------------------------------------------------------------------------
def test_rates_are_ratios_of_averages_and_unmeasured_rates_are_free():
    costs = StepCosts(0.1)
    assert costs.work_budget() is None  # no decode step measured: nothing bounds a step yet
    assert costs.rates() == (0.0, 0.0)
    costs.observe(StepWork(), 0.010, 0.0)
    assert costs.work_budget() == pytest.approx(0.090)
    costs.observe(StepWork(prefill_tokens=100, encoder_rows=64), 0.010 + 0.010 + 0.0256, 0.0256)
    assert costs.rates() == pytest.approx((0.0001, 0.0004))
    costs.observe(StepWork(prefill_tokens=3), 0.010 + 0.003, 0.0)  # a small step: it moves the rate, by its size
    token_s, _ = costs.rates()
    assert 0.0001 < token_s < 0.0002
    assert StepCosts(0.0).work_budget() is None  # --max-decode-stall-ms 0: no time bound
    tight = StepCosts(0.005)
    tight.observe(StepWork(), 0.010, 0.0)
    assert tight.work_budget() == 0.0  # a decode step alone takes longer: only each step's first window goes in


def test_the_affordable_end_pays_tokens_in_order_and_an_item_at_its_first_token():
    tokens, features = build([text("a", 10), ("x", ROWS), text("b", 30)])
    r = Request("r", tokens, features, RequestSampling(max_tokens=1))
    costs = StepCosts(0.1)
    costs.observe(StepWork(), DECODE_S, 0.0)
    costs.observe(StepWork(prefill_tokens=100, encoder_rows=ROWS), DECODE_S + 0.010 + ROWS * ROW_S, ROWS * ROW_S)
    whole = Window(0, len(tokens), [0], [])
    assert costs.affordable_end(r, whole, 1.0) == len(tokens)
    assert costs.affordable_end(r, whole, 0.0005) == 5  # 5 tokens of text, not the image
    assert costs.affordable_end(r, whole, 0.010) == 10  # the text, then the image does not fit: cut at its offset
    assert costs.affordable_end(r, whole, 0.001 + ROWS * ROW_S + 0.002) == 30  # text, image, 20 more tokens
    assert costs.window_cost(r, whole) == pytest.approx(len(tokens) * TOKEN_S + ROWS * ROW_S)
    assert least_end(r, whole, 16) == 10 + ROWS  # the image starts within the first block: it goes in whole
    assert least_end(r, Window(0, 8, [], []), 16) == 8


# --- steps -------------------------------------------------------------------------------------------------------
def test_a_burst_beside_decodes_is_spread_so_each_decode_step_stays_within_the_target():
    h = harness(100.0)
    decoding(h)
    first = len(h.log)
    for k in range(8):
        h.add(image_request(k))
    h.run()
    plans = decode_steps(h, first)
    assert max(stall_s(p) for p in plans) <= 0.100 + 1e-9
    # 90 ms of work a step: two whole image requests (33.6 ms each: 80 tokens and 64 rows), and a third's text
    assert max(len(p.encoder_inputs) for p in plans) == 2
    assert any(p.stall_bounded for p in plans)
    assert all(len(h.outputs[f"img{k}"]) == 2 for k in range(8))


def test_without_the_bound_the_same_burst_stalls_the_decodes_for_all_of_it_and_tokens_are_equal():
    outputs = {}
    for stall_ms in (0.0, 100.0):
        h = harness(stall_ms)
        decoding(h)
        first = len(h.log)
        for k in range(8):
            h.add(image_request(k))
        h.run()
        outputs[stall_ms] = h.outputs
        worst = max(stall_s(p) for p in decode_steps(h, first))
        if stall_ms == 0.0:
            assert worst > 0.2  # all eight images in one step: 8 × (25.6 ms + 18 tokens) + the decode step
    assert outputs[0.0] == outputs[100.0]  # the bound moves work between steps, never changes a token


def test_with_nothing_decoding_the_size_budgets_alone_apply():
    h = harness(100.0)
    h.add(request("warm", [text("w", 8), ("warm-img", ROWS), text("w2", 8)], max_tokens=1))
    h.add(request("dec", [text("d", 20)], max_tokens=1))
    h.run()  # every rate measured, nothing left running
    assert h.sched.costs.work_budget() is not None
    first = len(h.log)
    for k in range(8):
        h.add(image_request(k))
    h.step()
    assert len(h.log[first].plan.encoder_inputs) == 8  # a burst at an idle group: one step, as without the bound
    assert not h.log[first].plan.stall_bounded


def test_before_anything_is_measured_nothing_is_time_bounded():
    h = Harness("lazy", max_stall_ms=100.0, timing=None, keep_plans=True, encoder_tokens=4096)
    for k in range(2):
        h.add(request(f"dec{k}", [text(f"d{k}", 20)], max_tokens=30))
    h.step()
    h.step()
    for k in range(4):
        h.add(image_request(k))
    assert len(h.step().encoder_inputs) == 4


def test_an_image_costing_more_than_the_target_still_goes_in_one_per_step():
    h = harness(20.0)  # 10 ms of work per step: less than one image (25.6 ms)
    decoding(h)
    first = len(h.log)
    for k in range(4):
        h.add(image_request(k))
    h.run()
    plans = decode_steps(h, first)
    assert [len(p.encoder_inputs) for p in plans if p.encoder_inputs] == [1, 1, 1, 1]
    assert all(len(h.outputs[f"img{k}"]) == 2 for k in range(4))


def test_a_long_text_prompt_prefills_in_chunks_of_at_least_a_block_while_others_decode():
    h = harness(15.0)  # 5 ms of work: 50 tokens a step
    decoding(h)
    first = len(h.log)
    h.add(request("long", [text("long", 400)], max_tokens=1))
    h.run()
    chunks = [r.scheduled["long"] for r in h.log[first:] if "long" in r.scheduled]
    assert chunks == [50] * 8
    h2 = harness(10.5)  # 0.5 ms: five tokens would fit, the first prefill window still takes a block
    decoding(h2)
    first = len(h2.log)
    h2.add(request("long", [text("long", 64)], max_tokens=1))
    h2.run()
    assert [r.scheduled["long"] for r in h2.log[first:] if "long" in r.scheduled] == [16, 16, 16, 16]


def test_the_rest_of_a_burst_is_not_cut_for_the_burst_s_own_first_answers_but_later_requests_are():
    h = harness(40.0, step_encoder=2 * ROWS)  # two images a step by size; 30 ms of work a step by time: one
    h.add(request("warm", [text("w", 8), ("warm-img", ROWS), text("w2", 8)], max_tokens=3))
    h.run()  # every rate measured, nothing left running
    first = len(h.log)
    for k in range(8):
        h.add(image_request(k, max_tokens=20))
    for _ in range(5):
        h.step()  # the first answers decode while the rest of the burst, queued before them, prefills
    burst = [r.plan for r in h.log[first:] if r.encoder_inputs]
    assert [len(p.encoder_inputs) for p in burst] == [2, 2, 2, 2]  # the size budget alone: as without the bound
    assert not any(p.stall_bounded for p in burst)
    later = len(h.log)
    for k in (98, 99):  # queued while the burst's answers decode: cut to one image a step
        h.add(image_request(k, max_tokens=2))
    h.run()
    assert [len(r.encoder_inputs) for r in h.log[later:] if r.encoder_inputs] == [1, 1]
