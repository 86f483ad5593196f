"""Faults under live traffic on one real local deployment (LocalGroup: the scheduler and a TP=2 worker group as
processes, as `mmcast serve-local` runs them), every completed answer checked against the transformers oracle.

One group serves the whole module, in this order: clients that disconnect or run out of time free everything; a
short load of 32 clients; kill -9 of a rank mid-generation; a stalled rank (SIGSTOP/SIGCONT); the group down past
the deadline; kill -9 of the scheduler; SIGTERM to the scheduler (drain). Timings are printed as `FAULT {...}`
lines (docs/RELIABILITY.md quotes them); set MMCAST_SOAK_REPORT to a path to collect them as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import signal
import sys
import threading
import time

import psutil
import pytest

from mmcast_client import Client, DeadlineExceeded, Unavailable
from mmcast_local.supervisor import LocalGroup
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.load import Budgets, MiB, Workload, check_load, rss_of, run_load, write_report
from tests.support.oracle import Oracle, assert_matches, mismatch, scrape, user_turn, wait_until

pytestmark = pytest.mark.slow

TP = 2
N_LONG = 48  # tokens of the fault streams: long enough that a fault lands mid-generation
STEP_TIMEOUT = 5.0  # --step-timeout-seconds
STALL = 7.0  # seconds a rank stays SIGSTOPped: past the step deadline, within the group timeout
GROUP_TIMEOUT = 10.0  # worker --group-timeout-seconds
DEADLINE = 25.0  # --group-deadline-seconds: above a group restart here (~15 s), so a kill stays invisible
DRAIN = 6.0  # --drain-seconds
BUDGETS = Budgets(
    processor_cache_bytes=64 * MiB,
    upload_store_bytes=32 * MiB,
    kv_blocks=512,
    payload_cache_bytes=64 * MiB,
    encoder_cache_tokens=4096,
)
# A worker "command" that waits while a file exists, then becomes the real worker (same pid): lets a test keep a
# restarted group down for as long as it likes.
HOLD = "import os, sys, time\nwhile os.path.exists(sys.argv[1]):\n    time.sleep(0.05)\nos.execv(sys.argv[2], sys.argv[2:])\n"
WORKER_BIN = str(pathlib.Path(sys.executable).parent / "mmcast-worker")
FAULT_TEXTS = ("Tell me everything about this picture.", "What would a painter change here?")


def fault_messages(k: int) -> list[dict]:
    return [user_turn(synthetic_jpeg(7000 + k, (112, 112)), FAULT_TEXTS[k % 2])]


def report(name: str, **figures) -> None:
    line = {"name": name, **{k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}}
    print(f"\nFAULT {json.dumps(line, sort_keys=True)}")
    path = os.environ.get("MMCAST_SOAK_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


class Env:
    """The module's deployment, its oracle answers and a few readers."""

    def __init__(self, group: LocalGroup, oracle: Oracle, hold: pathlib.Path, baseline: dict[str, int]) -> None:
        self.group = group
        self.oracle = oracle
        self.hold = hold
        self.baseline = baseline

    def metric(self, name: str, source: str = "scheduler", **labels: str) -> float:
        return scrape(self.group.metrics_urls[source], name, **labels)

    def idle(self) -> bool:
        return all(
            self.metric(m) == 0 for m in ("mmcast_requests_running", "mmcast_requests_waiting", "mmcast_kv_blocks_used")
        )

    def rank_caches(self) -> list[tuple[float, float, float]]:
        """(payload bytes, payload items, encoder rows) per rank."""
        names = (
            "mmcast_worker_payload_cache_bytes",
            "mmcast_worker_payload_cache_items",
            "mmcast_worker_encoder_cache_tokens",
        )
        return [tuple(self.metric(n, f"rank{r}") for n in names) for r in range(TP)]

    def rank_epochs(self, rank: int) -> list[int]:
        path = self.group.log_dir / f"rank{rank}.log"
        lines = [json.loads(x) for x in path.read_text(errors="replace").splitlines() if x.startswith("{")]
        return [x["epoch"] for x in lines if x.get("msg") == "stream admitted"]


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("fault-logs")
    hold = logs / "hold"
    group = LocalGroup(
        tiny_model_dir,
        TP,
        "lazy",
        kv_blocks=BUDGETS.kv_blocks,
        scheduler_args=[
            *BUDGETS.scheduler_args(),
            "--step-timeout-seconds",
            str(STEP_TIMEOUT),
            "--keepalive-seconds",
            "2",
            "--group-deadline-seconds",
            str(DEADLINE),
            "--reconnect-backoff-max-seconds",
            "0.5",
            "--drain-seconds",
            str(DRAIN),
        ],  # fmt: skip
        worker_args=[*BUDGETS.worker_args(), "--group-timeout-seconds", str(GROUP_TIMEOUT)],
        worker_command=[sys.executable, "-c", HOLD, str(hold), WORKER_BIN],
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),  # a crash leaves its traceback in the rank's log
        log_dir=logs,
        ready_timeout=240,
        max_restarts=20,
    )
    group.start()
    try:
        oracle = Oracle(tiny_model_dir)
        for k in range(6):  # computed while the processes start
            oracle(fault_messages(k), N_LONG)
        group.wait_ready()
        yield Env(group, oracle, hold, rss_of(group))
    finally:
        for pid in group.pids().values():  # a failed stall test must not leave a rank stopped
            if pid:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        group.stop()


class Streams:
    """Concurrent streaming generations, one Client each (even: upload by hash; odd: image bytes inline)."""

    def __init__(self, env: Env, prompts: list[int], max_tokens: int = N_LONG, **client_kw) -> None:
        self.env = env
        self.prompts = prompts
        self.max_tokens = max_tokens
        self.client_kw = {"timeout": 300, "first_token_timeout": None, **client_kw}  # bounded by the whole call
        self.seen = [0] * len(prompts)  # tokens received so far
        self.outcomes: list = [None] * len(prompts)  # Result or exception
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(prompts))]

    def _run(self, i: int) -> None:
        try:
            with Client(self.env.group.target, upload_images=i % 2 == 0, **self.client_kw) as c:
                stream = c.generate(
                    fault_messages(self.prompts[i]),
                    max_tokens=self.max_tokens,
                    ignore_eos=True,
                    logprobs=0,
                    stream=True,
                )
                for delta in stream:
                    self.seen[i] += len(delta.token_ids)
                self.outcomes[i] = stream.result
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            self.outcomes[i] = exc

    def start(self) -> Streams:
        for t in self.threads:
            t.start()
        return self

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        assert wait_until(lambda: min(self.seen) >= n, timeout, 0.01), f"streams stuck at {self.seen}"

    def join(self, timeout: float = 240) -> list:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), f"streams still running after {timeout} s: {self.seen}"
        return self.outcomes

    def check(self, indices=None) -> None:
        """The outcomes at ``indices`` (all by default) are complete answers equal to the oracle's."""
        for i in range(len(self.prompts)) if indices is None else indices:
            outcome = self.outcomes[i]
            assert not isinstance(outcome, BaseException), f"stream {i}: {type(outcome).__name__}: {outcome}"
            assert outcome.finish_reason == "length"
            assert_matches(outcome, self.env.oracle(fault_messages(self.prompts[i]), self.max_tokens), f"stream {i}")


def serving(target: str, service: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- 1. clients that leave, and deadlines ----------------------------------------------------------------------------
def test_disconnects_and_expired_deadlines_free_everything(env):
    """Cancelled streams and client deadlines (before admission, mid-prefill, mid-decode) leave nothing running,
    waiting or holding KV blocks. Rank caches evict only when told, so they keep what the scheduler's mirror keeps:
    exactly the fresh images whose payload reached the ranks, which later requests then find rank-cached."""
    g = env.group
    assert wait_until(env.idle, 30)
    caches0 = env.rank_caches()
    recoveries0 = env.metric("mmcast_worker_group_recoveries_total")
    images = [synthetic_jpeg(8000 + k, (112, 112)) for k in range(8)]
    outcomes: list = [None] * len(images)

    def leave(i: int) -> None:
        messages = [user_turn(images[i], "Talk about this for a long time.")]
        try:
            with Client(g.target, upload_images=i % 2 == 0, timeout=60) as c:
                if i < 4:  # cancel after a few tokens
                    stream = c.generate(messages, max_tokens=2000, ignore_eos=True, stream=True)
                    got = 0
                    for delta in stream:
                        got += len(delta.token_ids)
                        if got >= 3:
                            stream.cancel()
                    outcomes[i] = ("cancelled", got)
                else:  # a client deadline: tight ones expire before admission, looser ones mid-generation
                    c.generate(messages, max_tokens=2000, ignore_eos=True, timeout=[0.05, 0.3, 1.0, 2.0][i - 4])
                    outcomes[i] = ("finished", None)
        except DeadlineExceeded:
            outcomes[i] = ("deadline", None)
        except Exception as exc:  # noqa: BLE001
            outcomes[i] = ("error", exc)

    threads = [threading.Thread(target=leave, args=(i,)) for i in range(len(images))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [o[0] for o in outcomes] == ["cancelled"] * 4 + ["deadline"] * 4, outcomes
    t0 = time.monotonic()
    assert wait_until(env.idle, 20), "requests still running, waiting or holding KV blocks"
    freed_after = time.monotonic() - t0
    caches1 = env.rank_caches()
    # Sharded placement: each payload sits on its owner rank alone; every rank holds every encoder output.
    assert caches1[0][2] == caches1[1][2], caches1
    grew_items = sum(caches1[r][1] - caches0[r][1] for r in range(TP))
    grew_rows = caches1[0][2] - caches0[0][2]
    assert grew_rows == 16 * grew_items  # each fresh 112x112 image: 16 encoder rows, one payload

    # The mirror agrees with the ranks: a request for each image now finds exactly the held ones rank-cached,
    # answers correctly, and no step is refused for a missing payload (no recovery).
    rank_cached = 0
    with Client(g.target, timeout=120) as c:
        for img in images:
            messages = [user_turn(img, "Describe the picture.")]
            result = c.generate(messages, max_tokens=8, ignore_eos=True, logprobs=0)
            assert_matches(result, env.oracle(messages, 8), "after the disconnects")
            rank_cached += result.usage.images_rank_cached // TP
    assert rank_cached == grew_items
    assert env.metric("mmcast_worker_group_recoveries_total") == recoveries0
    assert wait_until(env.idle, 10)
    report(
        "disconnects_and_deadlines",
        cancelled=4,
        deadlines=4,
        freed_within_s=freed_after,
        images_left_in_rank_caches=int(grew_items),
        recoveries=0,
    )


# -- 2. load ----------------------------------------------------------------------------------------------------------
def test_short_load_of_32_clients(env):
    workload = Workload(env.oracle, seed=3, n_base=6, n_fresh=24, max_tokens=8)
    bound = BUDGETS.bounds(env.baseline, env.oracle.model.config, tp=TP)
    result = run_load(env.group, workload, clients=32, seconds=20, rss_bound=bound, rss_baseline=env.baseline, seed=3)
    write_report("short_load", result)
    check_load(result)
    assert wait_until(env.idle, 20)


# -- 3. kill -9 of a worker rank ------------------------------------------------------------------------------------
def test_kill_9_of_a_rank_mid_generation_is_invisible_to_clients(env):
    g = env.group
    recoveries0 = env.metric("mmcast_worker_group_recoveries_total")
    streams = Streams(env, list(range(6))).start()
    streams.wait_tokens(2)
    rank0 = g.pids()["rank0"]
    t_kill = time.monotonic()
    generation = g.kill_rank(1, signal.SIGKILL)
    at_kill = list(streams.seen)
    assert wait_until(lambda: gone(rank0), GROUP_TIMEOUT + 2, 0.02), "rank 0 outlived its peer"
    peer_exit = time.monotonic() - t_kill
    g.wait_restarted(generation, timeout=120)
    group_back = time.monotonic() - t_kill
    streams.join(180)
    completed = time.monotonic() - t_kill
    streams.check()
    assert all(2 <= n < N_LONG for n in at_kill), at_kill  # every stream was mid-generation
    assert env.metric("mmcast_worker_group_recoveries_total") >= recoveries0 + 1
    report(
        "kill_rank",
        streams=6,
        tokens_before_kill=at_kill,
        peer_exit_s=peer_exit,
        group_ready_s=group_back,
        streams_complete_s=completed,
    )


# -- 4. a stalled rank ----------------------------------------------------------------------------------------------
def test_a_stalled_rank_trips_the_step_deadline_and_the_group_recovers(env):
    g = env.group
    recoveries0 = env.metric("mmcast_worker_group_recoveries_total")
    generation0 = g.generation
    streams = Streams(env, [0, 1, 2, 3]).start()
    streams.wait_tokens(2)
    pid = g.pids()["rank1"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        tripped = wait_until(lambda: env.metric("mmcast_worker_group_recoveries_total") > recoveries0, STALL, 0.05)
        detect = time.monotonic() - t0
        time.sleep(max(0.0, STALL - (time.monotonic() - t0)))
    finally:
        os.kill(pid, signal.SIGCONT)
    streams.join(180)
    completed = time.monotonic() - t0
    streams.check()
    assert tripped and STEP_TIMEOUT - 0.5 <= detect <= STEP_TIMEOUT + 2, detect
    # Either the ranks finished the stalled step together and the scheduler reconnected, or they were left on
    # different steps, saw it in the step vote and the group was restarted; both end in correct answers.
    report(
        "stalled_rank",
        stall_s=STALL,
        step_timeout_s=STEP_TIMEOUT,
        deadline_fired_after_s=detect,
        streams_complete_s=completed,
        group_restarted=g.generation > generation0,
    )


# -- 5. the group down past the deadline ----------------------------------------------------------------------------
def test_group_down_past_the_deadline_fails_with_unavailable_and_the_sdk_retry_succeeds(env):
    g = env.group
    streams = Streams(env, [0, 1, 2, 3], retries=0).start()
    streams.wait_tokens(2)
    env.hold.touch()  # the supervisor restarts the ranks, but they wait
    try:
        t_down = time.monotonic()
        generation = g.kill_rank(1, signal.SIGKILL)
        streams.join(DEADLINE + 30)
        failed_after = time.monotonic() - t_down
        # Tokens were already streamed, so the SDK may not retry: the error reaches the caller.
        for i, outcome in enumerate(streams.outcomes):
            assert isinstance(outcome, Unavailable), f"stream {i}: {outcome!r}"
            assert "--group-deadline-seconds" in outcome.message
        assert DEADLINE - 1 <= failed_after <= DEADLINE + 5, failed_after

        # A new request now would be refused at once with UNAVAILABLE; the scheduler reports its generation service
        # NOT_SERVING, so an SDK call with wait_for_ready=True waits on the channel until the group is back.
        # Release the ranks a moment after it started.
        retried: dict = {}

        def late_request() -> None:
            with Client(g.target, timeout=180, first_token_timeout=None, wait_for_ready=True) as c:
                t = time.monotonic()
                retried["result"] = c.generate(fault_messages(4), max_tokens=8, ignore_eos=True, logprobs=0)
                retried["seconds"] = time.monotonic() - t

        thread = threading.Thread(target=late_request)
        thread.start()
        time.sleep(2.0)
        assert thread.is_alive(), "the request should be waiting for the group"
    finally:
        env.hold.unlink(missing_ok=True)
    assert wait_until(lambda: all(serving(t, "mmcast.v1.WorkerService") for t in g.worker_targets), 120)
    ranks_ready = time.monotonic()
    g.wait_restarted(generation, timeout=120)
    reconnected = time.monotonic() - ranks_ready  # the scheduler reaches the ranks at its next attempt
    assert reconnected < 3.0, f"the scheduler took {reconnected:.1f} s to reach ranks that were serving"
    thread.join(120)
    assert "result" in retried, "the SDK's retry did not succeed"
    assert_matches(retried["result"], env.oracle(fault_messages(4), 8), "retried through the SDK")
    # The streams that failed are answered correctly when asked again.
    again = Streams(env, [0, 1, 2, 3]).start()
    again.join(120)
    again.check()
    report(
        "group_down_past_deadline",
        deadline_s=DEADLINE,
        streams_failed_after_s=failed_after,
        scheduler_reconnected_after_ranks_ready_s=reconnected,
        sdk_retry_succeeded_after_s=retried["seconds"],
    )


# -- 6. kill -9 of the scheduler ------------------------------------------------------------------------------------
def test_kill_9_of_the_scheduler_ranks_take_the_newer_epoch_and_clients_reconnect(env):
    g = env.group
    generation0 = g.generation  # the worker group's (re)starts so far
    epochs_before = [env.rank_epochs(r)[-1] for r in range(TP)]
    # A client that uploaded an image to the old scheduler, and keeps its record of it across the restart.
    keeper = Client(g.target, timeout=180, first_token_timeout=None, wait_for_ready=True)
    keeper.generate(fault_messages(3), max_tokens=2, ignore_eos=True)
    streams = Streams(env, [0, 1, 2, 3], retries=0).start()
    streams.wait_tokens(2)
    assert any(c[1] > 0 for c in env.rank_caches())  # the ranks hold this stream's items
    t_kill = time.monotonic()
    os.kill(g.pids()["scheduler"], signal.SIGKILL)
    streams.join(60)
    for i, outcome in enumerate(streams.outcomes):
        assert isinstance(outcome, Unavailable), f"stream {i}: {outcome!r}"  # mid-stream: not retried

    # The stale stream's state is dropped as soon as it breaks, unless the kill left the ranks on different steps:
    # the step vote then restarts the group, which may happen only once the new scheduler has connected.
    def dropped_or_restarted() -> bool:
        if g.generation > generation0:
            return True
        try:
            return all(c == (0.0, 0.0, 0.0) for c in env.rank_caches())
        except OSError:  # a rank's metrics port is down: it is exiting, and the group restarts
            return False

    assert wait_until(dropped_or_restarted, 30), "the ranks neither dropped the stale stream's state nor restarted"

    # Clients reconnect through the SDK (wait_for_ready: the call waits while the scheduler restarts and until it
    # reports its group serving); the new scheduler holds no uploads, so
    # the upload-by-hash clients are told NOT_FOUND and send the request again with the image inline, transparently.
    uploads = []
    original = keeper._upload
    keeper._upload = lambda sha, *rest: (uploads.append(sha), original(sha, *rest))
    try:
        kept = keeper.generate(fault_messages(3), max_tokens=8, ignore_eos=True, logprobs=0)
    finally:
        keeper.close()
    back = time.monotonic() - t_kill
    assert_matches(kept, env.oracle(fault_messages(3), 8), "same client across the scheduler restart")
    assert uploads == []  # NOT_FOUND from the new scheduler, then the same Generate with the image inline
    again = Streams(env, [0, 1, 2, 3], wait_for_ready=True).start()
    again.join(180)
    again.check()
    epochs_after = [env.rank_epochs(r)[-1] for r in range(TP)]
    assert all(a > b for a, b in zip(epochs_after, epochs_before, strict=True)), (epochs_before, epochs_after)
    assert epochs_after[0] == epochs_after[1]
    report("kill_scheduler", clients_answered_again_after_s=back, group_restarted=g.generation > generation0)


# -- 7. SIGTERM: drain ---------------------------------------------------------------------------------------------
def test_sigterm_drains_in_flight_requests_within_the_grace_period(env):
    g = env.group
    short = Streams(env, [0, 1, 2, 3], max_tokens=24, retries=0).start()
    long = Streams(env, [5], max_tokens=2000, retries=0).start()  # cannot finish within the grace period
    short.wait_tokens(1)
    long.wait_tokens(1)
    pid = g.pids()["scheduler"]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    refused: dict = {}

    def during_drain() -> None:  # NOT_SERVING while draining; wait_for_ready waits for the restarted scheduler
        with Client(g.target, timeout=180, first_token_timeout=None, wait_for_ready=True) as c:
            refused["result"] = c.generate(fault_messages(2), max_tokens=8, ignore_eos=True, logprobs=0)

    late = threading.Thread(target=during_drain)
    time.sleep(0.2)
    late.start()
    assert wait_until(lambda: gone(pid), DRAIN + 10, 0.05), "the scheduler did not exit"
    exited = time.monotonic() - t0
    short.join(30)
    long.join(30)
    short.check()
    cut = long.outcomes[0]
    assert not isinstance(cut, BaseException), repr(cut)
    assert cut.finish_reason == "cancelled" and 0 < len(cut.token_ids) < 2000
    expected = env.oracle(fault_messages(5), N_LONG)
    n = min(len(cut.token_ids), N_LONG)
    head = dataclasses.replace(cut, token_ids=cut.token_ids[:n], logprobs=cut.logprobs[:n])
    assert mismatch(head, (expected[0][:n], expected[1][:n])) is None  # what it streamed before the cut is right
    assert exited <= DRAIN + 5, exited  # the drain, the server's 1 s grace, closing the rank streams, exit
    late.join(180)
    assert "result" in refused
    assert_matches(refused["result"], env.oracle(fault_messages(2), 8), "sent during the drain")
    report(
        "sigterm_drain",
        drain_s=DRAIN,
        scheduler_exited_after_s=exited,
        in_flight_completed=4,
        long_request_cut_at_tokens=len(cut.token_ids),
    )
