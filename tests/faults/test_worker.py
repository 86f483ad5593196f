"""Real ``mmcast-worker`` processes at TP=2 whose ranks are left on different steps: one rank received a step its
peer never got (the scheduler died, or gave up on the step, between its writes to the two streams), then a newer
scheduler stream arrived on both. Collectives pair up by order, so without a check the peer's new step would pair
with the old one and compute on mixed partial sums; the step vote carries (epoch, step id) and both ranks exit at
once, well before the group timeout, so the supervisor restarts the group."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from tests.support.rank_group import Group as RankGroup
from tests.support.worker_driver import MiniScheduler, Prompt, rank_token_file
from worker_svc.config import WorkerConfig
from worker_svc.metrics import WorkerMetrics
from worker_svc.worker import StreamHandle, Worker

GROUP_TIMEOUT = 30.0  # long: only the vote may end the ranks quickly


def wait_exit(proc: subprocess.Popen, limit: float) -> float | None:
    t0 = time.monotonic()
    try:
        proc.wait(limit)
    except subprocess.TimeoutExpired:
        return None
    return time.monotonic() - t0


@pytest.mark.slow
def test_ranks_voting_on_different_steps_exit_instead_of_pairing_collectives(worker_env_q2, tmp_path):
    env = worker_env_q2
    group = RankGroup(str(env.model_dir), tmp_path, timeout_s=GROUP_TIMEOUT)
    try:
        old = MiniScheduler(group.streams())
        a = old.add(env.prompt(["Tell me a story about a lighthouse."]), "a", max_new_tokens=8)
        old.step([a])  # prefill
        old.step([a])  # one decode step on both ranks
        payloads, control, _ = old.build_step([a])  # a one-token decode step ...
        old.send(payloads, control, ranks=[0])  # ... that only rank 0 receives
        time.sleep(0.3)

        new = MiniScheduler(group.streams())  # a newer epoch supersedes the old stream on both ranks
        one_token = Prompt(token_ids=[a.prompt.token_ids[-1]], features=[], inputs={})
        b = new.add(one_token, "b", max_new_tokens=2)  # a one-token prefill: the same shapes as rank 0's decode
        payloads, control, _ = new.build_step([b])
        new.send(payloads, control)
        try:
            answer = new.streams[1].recv(timeout=10)
        except Exception:  # noqa: BLE001 - the stream broke: rank 1 exited
            answer = None
        assert answer is None or answer.WhichOneof("frame") != "step_result", "rank 1 computed the new step"

        waited = [wait_exit(p, 15) for p in group.procs]
        assert all(w is not None for w in waited), f"ranks still running after 15 s (group timeout {GROUP_TIMEOUT} s)"
        assert all(p.returncode not in (0, None) for p in group.procs)
        for rank in (0, 1):
            lines = [json.loads(x) for x in group.logs[rank].read_text().splitlines() if x.startswith("{")]
            fatal = [x for x in lines if x["level"] == "critical"]
            assert fatal and "tensor-parallel group" in fatal[-1]["msg"], lines[-3:]
            assert "another step" in fatal[-1]["error"], fatal[-1]
    finally:
        group.stop()


def test_a_stream_closing_during_shutdown_is_not_an_error(tmp_path):
    """SIGTERM stops the gRPC server, then the compute executor; a stream handler cancelled after that must not
    raise from its cleanup (it used to log "Unexpected RuntimeError raised by servicer method Step")."""
    worker = Worker(WorkerConfig(model=str(tmp_path), shared_token_file=rank_token_file()), WorkerMetrics())
    session = type("Session", (), {"clear": lambda self: None})()
    handle = StreamHandle(epoch=7, session=session, superseded=asyncio.Event())
    worker.gate.admit(7)
    worker.active = handle
    worker.executor.shutdown(wait=True)
    worker.close_stream(handle)
    assert worker.active is None and worker.gate.active_epoch is None
