"""The TTFT breakdown's arithmetic (scheduler_svc/engine/stage_timing.py) on hand-made step answers; the end-to-end
values on real ranks are tests/service/test_request_stages.py's."""

from __future__ import annotations

import pytest

from mmcast.v1 import worker_pb2
from scheduler_svc.engine.stage_timing import DISJOINT_STAGES, RANK_PARTS, STAGES, RequestStages, StepTimes


def answer(step: float, encode: float = 0.0, forward: float = 0.0, sample: float = 0.0, assemble: float = 0.0):
    result = worker_pb2.StepResult()
    s = result.stats
    for field, seconds in (
        (s.step_time, step),
        (s.encoder_time, encode),
        (s.forward_time, forward),
        (s.sample_time, sample),
        (s.assemble_time, assemble),
    ):
        field.FromNanoseconds(round(seconds * 1e9))
    return result


def test_a_steps_stages_take_the_slowest_rank_and_split_its_window():
    times = StepTimes(
        schedule=0.001,
        send=0.002,
        round_trip=0.010,
        results=[
            answer(0.006, forward=0.004, sample=0.001),
            answer(0.008, encode=0.003, forward=0.0045, assemble=0.0005),
        ],
    )
    stages = times.stages()
    assert stages["rank"] == pytest.approx(0.008) and stages["result_back"] == pytest.approx(0.002)
    assert stages["step_send"] == pytest.approx(0.002) and stages["schedule"] == 0.001
    assert (stages["rank_encode"], stages["rank_forward"], stages["rank_sample"]) == pytest.approx(
        (0.003, 0.0045, 0.001)
    )
    assert stages["rank_assemble"] == pytest.approx(0.0005)


def test_a_rank_that_starts_during_the_send_is_not_counted_twice():
    # rank 0's control was written first: its step (11 ms) began before the writes to its peer ended
    stages = StepTimes(schedule=0.0, send=0.004, round_trip=0.010, results=[answer(0.011), answer(0.009)]).stages()
    assert stages["rank"] == pytest.approx(0.011) and stages["result_back"] == 0.0
    assert stages["step_send"] + stages["rank"] + stages["result_back"] == pytest.approx(0.014)
    assert stages["step_send"] == pytest.approx(0.003)


def test_a_request_reports_only_what_was_measured_in_stage_order():
    stages = RequestStages(http_parse=0.0002, frontend=0.003, queue=0.001)
    assert list(stages.seconds()) == ["http_parse", "frontend", "queue"]  # no token yet: no step, no first byte
    stages.first_token_step = StepTimes(0.001, 0.001, 0.005, [answer(0.004, forward=0.003)])
    stages.detokenize, stages.first_byte = 0.00005, 0.0004
    seconds = stages.seconds()
    assert list(seconds) == list(STAGES) and set(STAGES) == set(DISJOINT_STAGES) | set(RANK_PARTS)
    assert sum(seconds[s] for s in DISJOINT_STAGES) == pytest.approx(0.0002 + 0.003 + 0.001 + 0.001 + 0.006 + 0.00045)
