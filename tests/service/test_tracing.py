"""Optional OpenTelemetry tracing (common/tracing.py): nothing of OpenTelemetry is imported while it is off, a bad
setting names its fix, and one request through a real scheduler and a real rank leaves the documented spans.

The span test runs the scheduler server and the rank in this process (tests/support/worker_driver.py's InProcessWorker,
the way tests/service/test_request_failures.py does), because the in-memory exporter that collects the spans must live in
the process that makes them."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import grpc
import pytest

from common import tracing
from mmcast.v1 import generation_pb2_grpc as gg
from tests.support.chat import IMG_A, image, request, text, user

# Every module with a tracing call site, and the entry points that configure it.
MODULES = (
    "common.tracing",
    "scheduler_svc.main",
    "scheduler_svc.doors.servicer",
    "scheduler_svc.engine.step_loop",
    "scheduler_svc.transport.rank_streams",
    "worker_svc.main",
    "worker_svc.servicer",
)


def test_nothing_of_opentelemetry_is_imported_while_tracing_is_off_and_a_bad_setting_stops_the_scheduler(
    tiny_model_dir,
):
    """One interpreter (imports are the cost): the modules load and run their no-op spans without OpenTelemetry;
    then the scheduler's entry point, given an exporter nobody installed, exits 2 naming it."""
    script = "\n".join(
        [
            "import importlib, os, sys",
            *[f"importlib.import_module({m!r})" for m in MODULES],
            "from common import tracing",
            "assert tracing.configure('scheduler') is False and not tracing.enabled()",
            "with tracing.span('mmcast.step', step_id=1) as s:",
            "    tracing.set_attributes(s, tokens=3)",
            "tracing.record_span('mmcast.schedule', 0, 1)",
            "loaded = [m for m in sys.modules if m.startswith('opentelemetry')]",
            "assert not loaded, loaded",
            "import opentelemetry.sdk.trace  # installed (the dev extra): the check above was not vacuous",
            "os.environ.update(MMCAST_TRACING='1', OTEL_TRACES_EXPORTER='zipkin')",
            "from scheduler_svc.main import main",
            f"main(['--model', {str(tiny_model_dir)!r}, '--workers', '127.0.0.1:1'])",
        ]
    )
    # MMCAST_ALLOCATOR_ENV_SET=0: main() must not re-exec this script (it would rerun it with the new variables).
    env = {**{k: v for k, v in os.environ.items() if k != tracing.ENV}, "MMCAST_ALLOCATOR_ENV_SET": "0"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "OTEL_TRACES_EXPORTER names 'zipkin', which no installed package provides" in proc.stderr


def test_settings_that_cannot_work_name_the_fix():
    with pytest.raises(tracing.TracingError, match="MMCAST_TRACING='maybe': use 1"):
        tracing.configure("scheduler", environ={"MMCAST_TRACING": "maybe"})
    with pytest.raises(tracing.TracingError, match="'zipkin', which no installed package provides.*console"):
        tracing.configure("scheduler", environ={"MMCAST_TRACING": "1", "OTEL_TRACES_EXPORTER": "zipkin"})
    assert not tracing.enabled()
    try:
        assert tracing.configure("scheduler", environ={"MMCAST_TRACING": "on", "OTEL_TRACES_EXPORTER": "none"})
        assert tracing.enabled()
    finally:
        tracing.reset()


@pytest.fixture(scope="module")
def traced_service(tiny_model_dir):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from scheduler_svc.config import SchedulerConfig
    from scheduler_svc.server import SchedulerServer
    from tests.support.service_harness import LoopThread
    from tests.support.worker_driver import InProcessWorker, rank_token_file
    from worker_svc.config import WorkerConfig

    exporter = InMemorySpanExporter()
    assert tracing.configure("test", exporter=exporter)
    rank = InProcessWorker(
        WorkerConfig(
            model=str(tiny_model_dir),
            listen="127.0.0.1:0",
            kv_blocks=256,
            scheduler_id="test",
            shared_token_file=rank_token_file(),
        )
    )
    lt = LoopThread()
    server = SchedulerServer(
        SchedulerConfig(
            model=str(tiny_model_dir),
            workers=[rank.target],
            listen="127.0.0.1:0",
            metrics_port=0,
            scheduler_id="test",
            worker_token_file=rank_token_file(),
        )
    )

    async def up():
        port = await server.start()
        assert await server.engine.wait_ready(30), server.engine.last_down_reason
        return port

    try:
        port = lt.run(up())
        yield f"127.0.0.1:{port}", exporter
    finally:
        lt.run(server.stop(drain_seconds=0))
        lt.close()
        rank.stop()
        tracing.reset()


def test_one_request_leaves_frontend_schedule_step_broadcast_and_rank_step_spans(traced_service):
    target, exporter = traced_service
    exporter.clear()
    with grpc.insecure_channel(target) as ch:
        responses = list(
            gg.GenerationServiceStub(ch).Generate(
                request([user(image(IMG_A), text("what is this?"))], max_tokens=3, request_id="traced-1"), timeout=60
            )
        )
    final = responses[-1].final
    assert final.usage.completion_tokens == 3
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)

    (frontend,) = by_name["mmcast.frontend"]
    assert frontend.attributes["mmcast.request_id"] == "traced-1"
    assert frontend.attributes["mmcast.prompt_tokens"] == final.usage.prompt_tokens
    assert frontend.attributes["mmcast.images"] == 1

    steps = [s for s in by_name["mmcast.step"] if "traced-1" in s.attributes["mmcast.request_ids"]]
    assert len(steps) >= 3, "a prefill and a step per further token"  # 3 tokens: at least 3 steps
    step_ids = {s.attributes["mmcast.step_id"] for s in steps}
    assert sum(s.attributes["mmcast.new_requests"] for s in steps) == 1
    assert sum(s.attributes["mmcast.encoder_inputs"] for s in steps) == 1
    schedules = {s.attributes["mmcast.step_id"]: s for s in by_name["mmcast.schedule"]}
    assert step_ids <= schedules.keys()
    for step in steps:  # the schedule call comes first; the broadcast is the step's child, inside it
        schedule = schedules[step.attributes["mmcast.step_id"]]
        assert schedule.end_time <= step.start_time
        (broadcast,) = [
            b for b in by_name["mmcast.broadcast"] if b.parent is not None and b.parent.span_id == step.context.span_id
        ]
        assert broadcast.context.trace_id == step.context.trace_id
        assert broadcast.attributes["mmcast.step_id"] == step.attributes["mmcast.step_id"]
        assert step.start_time <= broadcast.start_time <= broadcast.end_time <= step.end_time
        assert broadcast.attributes["mmcast.control_bytes"] > 0 and broadcast.attributes["mmcast.ranks"] == 1
    assert (
        sum(
            b.attributes["mmcast.payload_items"]
            for b in by_name["mmcast.broadcast"]
            if b.attributes["mmcast.step_id"] in step_ids
        )
        == 1
    )  # the image's payload, once (lazy)

    # The rank's spans: own traces, matched to the scheduler's by step id and request ids. A rank's span ends
    # just after it wrote the result, which may be after the client got its final message.
    deadline = time.monotonic() + 10
    while True:
        rank_steps = {
            s.attributes["mmcast.step_id"]: s for s in exporter.get_finished_spans() if s.name == "mmcast.rank_step"
        }
        if step_ids <= rank_steps.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert step_ids <= rank_steps.keys()
    for step in steps:
        rank_step = rank_steps[step.attributes["mmcast.step_id"]]
        assert rank_step.parent is None and rank_step.context.trace_id != step.context.trace_id
        assert "traced-1" in rank_step.attributes["mmcast.request_ids"]
        assert rank_step.attributes["mmcast.rank"] == 0
        assert step.start_time <= rank_step.start_time <= step.end_time
