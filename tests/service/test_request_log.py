"""The finished-request log record, in-process against fake ranks: it carries what the client's final message
carries, a client that leaves still gets its line, and the JSON formatter writes it with millisecond times.
(tests/deploy/test_live_prometheus.py checks the same lines from real processes against the SDK's Results.)"""

from __future__ import annotations

import json
import logging
import re
import time

import grpc
import pytest

from common.process import JsonFormatter, iso_time
from mmcast.v1 import generation_pb2 as g
from mmcast.v1 import generation_pb2_grpc as gg
from scheduler_svc.engine.request_log import FINISHED_MESSAGE
from scheduler_svc.engine.stage_timing import DISJOINT_STAGES, STAGES
from tests.support.chat import IMG_A, IMG_B, image, request, text, user
from tests.support.service_harness import FakeGroupScheduler

_FINISH = {g.FINISH_REASON_LENGTH: "length", g.FINISH_REASON_STOP: "stop"}


def finished_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == FINISHED_MESSAGE]


def wait_for_records(caplog, count: int, timeout: float = 10.0) -> list[logging.LogRecord]:
    deadline = time.monotonic() + timeout
    while len(finished_records(caplog)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return finished_records(caplog)


@pytest.fixture(scope="module")
def harness(tiny_model_dir):
    h = FakeGroupScheduler(tiny_model_dir, n_ranks=2, transfer_mode="lazy").start()
    yield h
    h.stop()


def test_finished_line_carries_the_final_messages_numbers(harness, caplog):
    caplog.set_level(logging.INFO, logger="scheduler_svc.servicer")
    messages = [user(image(IMG_A), image(IMG_B), text("describe both"))]
    finals = []
    with grpc.insecure_channel(harness.target) as ch:
        stub = gg.GenerationServiceStub(ch)
        for rid in ("log-1", "log-2"):  # the second finds the first's prefix and images cached
            finals.append(
                [
                    r.final
                    for r in stub.Generate(request(messages, max_tokens=5, request_id=rid))
                    if r.HasField("final")
                ][0]
            )
    records = wait_for_records(caplog, 2)
    assert [r.request_id for r in records] == ["log-1", "log-2"]
    for record, final in zip(records, finals, strict=True):
        assert record.levelno == logging.INFO and record.finish_reason == _FINISH[final.finish_reason]
        for key in (
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "images",
            "payload_bytes_broadcast",
            "payload_bytes_saved",
            "preemptions",
        ):
            assert getattr(record, key) == getattr(final.usage, key), key
        # the final message's Durations carry microseconds (datetime.timedelta's resolution)
        t = final.timings
        assert record.time_to_first_token_seconds == pytest.approx(
            t.time_to_first_token.ToNanoseconds() / 1e9, abs=2e-6
        )
        assert record.total_seconds == pytest.approx(t.total_time.ToNanoseconds() / 1e9, abs=2e-6)
        assert record.queue_seconds == pytest.approx(t.queue_time.ToNanoseconds() / 1e9, abs=2e-6)
        assert not hasattr(record, "tenant") and not hasattr(record, "error_code")
        # its TTFT breakdown (fake ranks report no step time of their own): up to the engine's delivery, the
        # disjoint stages lie inside the server's TTFT
        stages = {s: getattr(record, f"ttft_{s}_seconds") for s in STAGES}
        assert all(v >= 0 for v in stages.values()) and stages["frontend"] > 0, stages
        engine_side = sum(stages[s] for s in DISJOINT_STAGES if s not in ("detokenize", "first_byte"))
        assert engine_side <= record.time_to_first_token_seconds + 1e-5 * len(DISJOINT_STAGES), stages
    assert finals[0].usage.payload_bytes_broadcast > 0 and records[1].cached_tokens > 0
    assert records[1].payload_bytes_saved > 0

    line = json.loads(JsonFormatter("scheduler").format(records[0]))
    assert line["msg"] == FINISHED_MESSAGE and line["level"] == "info" and line["request_id"] == "log-1"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"]), line["time"]
    assert line["time"] == iso_time(line["ts"]) or line["time"] == iso_time(records[0].created)
    assert line["completion_tokens"] == finals[0].usage.completion_tokens


def test_a_client_that_leaves_still_gets_its_line(harness, caplog):
    caplog.set_level(logging.INFO, logger="scheduler_svc.servicer")
    with grpc.insecure_channel(harness.target) as ch:
        call = gg.GenerationServiceStub(ch).Generate(
            request([user(text("a long story please"))], max_tokens=400, request_id="log-gone")
        )
        received = len(next(call).delta.token_ids)
        call.cancel()
    (record,) = wait_for_records(caplog, 1)
    assert record.request_id == "log-gone" and record.finish_reason == "cancelled"
    assert received <= record.completion_tokens < 400
    assert record.time_to_first_token_seconds is not None
    assert 0 < record.queue_seconds <= record.time_to_first_token_seconds <= record.total_seconds


def test_iso_time_has_milliseconds_and_truncates():
    assert iso_time(0.0) == "1970-01-01T00:00:00.000Z"
    assert iso_time(1764622328.1239) == "2025-12-01T20:52:08.123Z"
    assert iso_time(59.9999) == "1970-01-01T00:00:59.999Z"  # never rounds up into the next second


def test_with_authentication_the_line_names_the_tenant(tiny_model_dir, tmp_path, caplog):
    from tests.support.security_support import new_token, secret_file

    token = new_token()
    tokens = secret_file(tmp_path / "tokens.json", json.dumps({token: "acme"}))
    h = FakeGroupScheduler(tiny_model_dir, n_ranks=1, auth_tokens_file=str(tokens)).start()
    try:
        caplog.set_level(logging.INFO, logger="scheduler_svc.servicer")
        with grpc.insecure_channel(h.target) as ch:
            responses = list(
                gg.GenerationServiceStub(ch).Generate(
                    request([user(text("hello"))], max_tokens=2, request_id="t-1"),
                    metadata=(("authorization", f"Bearer {token}"),),
                    timeout=30,
                )
            )
    finally:
        h.stop()
    (record,) = wait_for_records(caplog, 1)
    assert record.tenant == "acme" and record.request_id == "acme/t-1"  # scoped, as every line of the request
    assert responses[-1].final.request_id == "t-1"
    assert record.completion_tokens == responses[-1].final.usage.completion_tokens == 2
