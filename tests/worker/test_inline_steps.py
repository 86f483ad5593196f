"""Short steps on the rank's event-loop thread (``worker_svc/inline_steps.py``): which steps qualify, how the
estimate of a size class moves, and on an in-process rank that decode steps run there with the same tokens as on
the compute thread, while admissions, and any step while the compute thread is busy, run on the compute thread."""

from __future__ import annotations

import threading
import time

import pytest

from mmcast.v1 import worker_pb2
from tests.support.worker_driver import MiniScheduler
from worker_svc.inline_steps import MAX_TOKENS, InlineSteps, step_tokens

GREEDY = worker_pb2.WorkerSampling(temperature=0.0, top_p=1.0)


def decode_control(rows: int) -> worker_pb2.StepControl:
    control = worker_pb2.StepControl(step_id=1)
    for k in range(rows):
        control.running.add(request_id=f"r{k}", num_scheduled_tokens=1)
    return control


def test_only_steps_of_running_requests_alone_count_their_tokens():
    assert step_tokens(decode_control(3)) == 3
    admits = decode_control(1)
    admits.new_requests.add(request_id="n", num_scheduled_tokens=1)
    encodes = decode_control(1)
    encodes.encoder_inputs.add(item_identifier="sha256:" + "0" * 64)
    resets = decode_control(1)
    resets.reset_caches = True
    assert [step_tokens(c) for c in (admits, encodes, resets)] == [None, None, None]


def test_a_size_class_runs_inline_only_once_measured_short():
    inline = InlineSteps(0.010)
    four, five = decode_control(4), decode_control(5)
    assert not inline.fits(four)  # not measured yet: the compute thread first
    inline.observe(four, 0.002)
    assert inline.fits(four) and inline.fits(decode_control(7))  # 4..7 rows: one class
    assert not inline.fits(decode_control(8))  # the next class is its own
    inline.observe(five, 0.050)  # a slow step of the class: the next ones go to the compute thread at once
    assert not inline.fits(four)
    for _ in range(20):  # faster steps bring the estimate back down, gradually
        inline.observe(four, 0.002)
    assert inline.fits(four)


def test_no_step_runs_inline_when_off_too_large_or_not_eligible():
    off = InlineSteps(0.0)
    off.observe(decode_control(1), 0.0001)
    assert not off.fits(decode_control(1))
    inline = InlineSteps(10.0)
    big = decode_control(1)
    big.running[0].num_scheduled_tokens = MAX_TOKENS + 1
    inline.observe(big, 0.001)
    assert not inline.fits(big)
    admits = decode_control(1)
    admits.new_requests.add(request_id="n", num_scheduled_tokens=1)
    inline.observe(admits, 0.001)
    assert not inline.fits(admits)


@pytest.mark.parametrize(("threads", "on_loop"), [(1, True), (2, False)])
def test_only_a_rank_of_one_thread_computes_on_its_event_loop(tiny_model_dir, threads, on_loop):
    """With more intra-op threads, torch work on a second thread would start a second OpenMP team."""
    from tests.support.worker_driver import rank_token_file
    from worker_svc.config import WorkerConfig
    from worker_svc.metrics import WorkerMetrics
    from worker_svc.worker import Worker

    config = WorkerConfig(model=str(tiny_model_dir), threads=threads, shared_token_file=rank_token_file())
    worker = Worker(config, WorkerMetrics())
    try:
        control = decode_control(1)
        worker.inline.observe(control, 0.001)
        assert (worker.loop_computes, worker.inline.fits(control)) == (on_loop, on_loop)
    finally:
        worker.executor.shutdown()


@pytest.fixture
def env(worker_env_q2):
    """The shared rank with short steps on its event loop: its tests run it with two threads, where a served rank
    would keep every step on the compute thread; the choice of thread is what these tests check."""
    worker = worker_env_q2.rank.worker
    before = worker.inline, worker.loop_computes
    worker.loop_computes = True
    yield worker_env_q2
    worker.inline, worker.loop_computes = before


def _steps(env) -> dict[str, float]:
    return {t: env.rank.metrics.steps.labels(t)._value.get() for t in ("event_loop", "compute")}


def _serve(env, prompt, inline: InlineSteps, tokens: int = 6) -> list[int]:
    env.rank.worker.inline = inline
    stream = env.rank.stream(env.model_dir)
    sched = MiniScheduler([stream])
    reqs = [sched.add(prompt, rid, max_new_tokens=tokens, sampling=GREEDY) for rid in ("a", "b")]
    sched.run(reqs)
    stream.close()
    return [t for r in reqs for t in r.outputs]


def test_decode_steps_run_on_the_event_loop_with_the_compute_thread_s_tokens(env):
    prompt = env.prompt(["Name three colours."])
    before = _steps(env)
    on_compute = _serve(env, prompt, InlineSteps(0.0))
    middle = _steps(env)
    assert middle["event_loop"] == before["event_loop"]  # off: every step on the compute thread
    inline = _serve(env, prompt, InlineSteps(5.0))
    after = _steps(env)
    assert inline == on_compute
    # the admission and the first decode step of its size on the compute thread; the other decode steps inline
    assert after["event_loop"] - middle["event_loop"] >= 3, (before, middle, after)
    assert after["compute"] - middle["compute"] >= 2, (before, middle, after)


def test_a_step_waits_for_a_busy_compute_thread_instead_of_running_beside_it(env):
    prompt = env.prompt(["Name three colours."])
    inline = InlineSteps(5.0)
    _serve(env, prompt, inline, tokens=3)  # measures the decode class
    stream = env.rank.stream(env.model_dir)
    sched = MiniScheduler([stream])
    req = sched.add(prompt, "a", max_new_tokens=4, sampling=GREEDY)
    sched.step([req])  # admitted and prefilled: the next step is a decode step of the measured class
    release, started = threading.Event(), threading.Event()

    def busy():
        started.set()
        release.wait(30)

    running = env.rank.worker.on_compute(busy)  # e.g. another stream's step, or a closed stream's clearing
    assert started.wait(30)
    before = _steps(env)
    payloads, control, _plan = sched.build_step([req])
    sched.send(payloads, control)
    deadline = time.monotonic() + 30
    while _steps(env)["compute"] == before["compute"] and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _steps(env)  # queued behind the busy compute thread, not run beside it on the event loop
    assert (after["compute"] - before["compute"], after["event_loop"] - before["event_loop"]) == (1, 0)
    assert not running.done()
    release.set()
    running.result(30)
    assert stream.recv().step_result.step_id == control.step_id
    stream.close()
