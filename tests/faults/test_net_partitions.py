"""Network faults between the scheduler and its ranks, under live streams, every answer checked against the
transformers oracle: partitions below and past the step deadline, the collective's link cut while the step
streams stay up, a 1 Mbit/s link while a new 1280x720 image travels, and a flapping link.

One deployment serves the module: the scheduler and a TP=2 group, each process in its own network namespace on
veth links (tests/support/net_group.py), the ranks' collectives forced onto the links (gloo over TCP). Every test
sends streams with new images (their payload crosses the faulty link) and images the ranks already hold; after the
fault it checks that every stream completed equal to the oracle or failed with a status naming the cause, that the
tokens the client saw were neither repeated nor skipped, that the scheduler's cache mirrors agree with the ranks'
caches (the same images asked again are answered without a refused step or a recovery), that RSS stayed bounded,
and that the metrics and logs show the fault. Figures: one ``NETFAULT {...}`` line per test (pytest -s).

The short faults run in `make test`; the long ones (`chaos` marker) in `make chaos`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from mmcast_client import Client
from mmcast_local.synthetic_images import synthetic_jpeg
from tests.support.load import Budgets, MiB, rss_of
from tests.support.net_group import NetGroup
from tests.support.net_traffic import Streams, report
from tests.support.netlab import NetLab, lab_namespaces, pid_alive, unavailable_reason
from tests.support.oracle import Oracle, assert_matches, scrape, user_turn, wait_until

pytestmark = pytest.mark.slow

TP = 2
N_TOKENS = 32  # tokens per fault stream: a fault lands mid-generation
STEP_TIMEOUT = 15.0  # --step-timeout-seconds: a 2 s partition (3 s with TCP's retransmission backoff) stays below
KEEPALIVE = 2.0  # --keepalive-seconds
GROUP_TIMEOUT = 10.0  # worker --group-timeout-seconds: a collective waiting longer ends the rank
DEADLINE = 60.0  # --group-deadline-seconds: above a 30 s partition plus a group restart
BUDGETS = Budgets(
    processor_cache_bytes=64 * MiB,
    upload_store_bytes=32 * MiB,
    kv_blocks=512,
    payload_cache_bytes=64 * MiB,
    encoder_cache_tokens=8192,
)
TEXTS = ("Tell me everything about this picture.", "What would a painter change here?")


def prompt(seed: int, size=(112, 112), text: int = 0) -> list[dict]:
    return [user_turn(synthetic_jpeg(seed, size), TEXTS[text % 2])]


class Env:
    def __init__(self, lab: NetLab, group: NetGroup, oracle: Oracle, baseline: dict[str, int]) -> None:
        self.lab, self.group, self.oracle, self.baseline = lab, group, oracle, baseline
        self.sched, (self.rank0, self.rank1) = group.sched, group.ranks
        self.bound = BUDGETS.bounds(baseline, oracle.model.config, tp=TP)
        self._seed = 20_000

    def metric(self, name: str, source: str = "scheduler", **labels: str) -> float:
        return scrape(self.group.metrics_urls[source], name, **labels)

    def slow_steps(self) -> float:
        """Steps that took over a second (mmcast_step_seconds): how a fault the group rode through still shows."""
        total = self.metric("mmcast_step_seconds_bucket", le="+Inf")
        return total - self.metric("mmcast_step_seconds_bucket", le="1.0")

    def idle(self) -> bool:
        names = ("mmcast_requests_running", "mmcast_requests_waiting", "mmcast_kv_blocks_used")
        return all(self.metric(m) == 0 for m in names)

    def fresh(self, n: int, size=(112, 112)) -> list[list[dict]]:
        """``n`` prompts with images never sent before."""
        out = [prompt(self._seed + k, size, k) for k in range(n)]
        self._seed += n
        return out

    def warm(self, prompts: list[list[dict]]) -> None:
        """Send each prompt once, so its image is in the ranks' caches and the prefix cache."""
        with Client(self.group.target, timeout=120) as c:
            for p in prompts:
                assert_matches(c.generate(p, max_tokens=4, ignore_eos=True, logprobs=0), self.oracle(p, 4), "warm")

    def traffic(self, n_new: int = 2, n_cached: int = 2) -> Streams:
        self.group.wait_ready(240)  # a fault before may have left the group restarting
        new = self.fresh(n_new)
        cached = self.fresh(n_cached)
        self.warm(cached)
        cached = [[user_turn(p[0]["content"][0]["image"], TEXTS[1])] for p in cached]  # same image, new question
        prompts = [x for pair in zip(new, cached, strict=True) for x in pair]
        for p in prompts:
            self.oracle(p, N_TOKENS)
        return Streams(self.group.target, prompts, self.oracle, N_TOKENS)

    def check_after(self, streams: Streams, what: str) -> None:
        """Nothing left running; the mirrors agree with the ranks' caches; RSS within its bound."""
        self.group.wait_ready(240)  # the group the fault took down is back (readiness needs every rank)
        assert wait_until(self.idle, 60), f"{what}: requests still running, waiting or holding KV blocks"
        recoveries = self.metric("mmcast_worker_group_recoveries_total")
        rows = [self.metric("mmcast_worker_encoder_cache_tokens", f"rank{r}") for r in range(TP)]
        assert rows[0] == rows[1], f"{what}: the ranks' encoder caches differ: {rows}"
        # A mirror that believed a rank held a payload it lost would send none: the rank would refuse the step and
        # the group would recover. The same images again: answered right, no recovery.
        with Client(self.group.target, timeout=120) as c:
            for p in streams.prompts:
                again = [user_turn(p[0]["content"][0]["image"], "Describe the picture.")]
                assert_matches(
                    c.generate(again, max_tokens=4, ignore_eos=True, logprobs=0), self.oracle(again, 4), what
                )
        assert self.metric("mmcast_worker_group_recoveries_total") == recoveries, f"{what}: a step was refused"
        rss = rss_of(self.group)
        over = {k: (v, self.bound[k]) for k, v in rss.items() if k in self.bound and v > self.bound[k]}
        assert not over, f"{what}: RSS over its bound (bytes, bound): {over}"

    def log_lines(self, name: str, since: float) -> list[dict]:
        """JSON log lines of process ``name`` written after wall-clock time ``since``."""
        path = self.group.log_dir / f"{name}.log"
        out = []
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                out.append(record)
        return [r for r in out if _wall(r) >= since]


def _wall(record: dict) -> float:
    ts = record.get("ts") or record.get("time") or record.get("timestamp")
    if isinstance(ts, (int, float)):
        return float(ts)
    try:
        import datetime

        return datetime.datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


@pytest.fixture(scope="module")
def lab():
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with NetLab() as made:
        yield made
    left = [n for n in lab_namespaces() if n.startswith(made.tag)]
    assert not left, f"namespaces left after the lab closed: {left}"


@pytest.fixture(scope="module")
def env(lab, tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("netfault-logs")
    group = NetGroup(
        lab,
        tiny_model_dir,
        TP,
        "lazy",
        kv_blocks=BUDGETS.kv_blocks,
        scheduler_args=[
            *BUDGETS.scheduler_args(),
            "--step-timeout-seconds",
            str(STEP_TIMEOUT),
            "--keepalive-seconds",
            str(KEEPALIVE),
            "--group-deadline-seconds",
            str(DEADLINE),
            "--reconnect-backoff-max-seconds",
            "0.5",
        ],  # fmt: skip
        worker_args=[*BUDGETS.worker_args(), "--group-timeout-seconds", str(GROUP_TIMEOUT)],
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),
        log_dir=logs,
        ready_timeout=240,
        max_restarts=20,
    )
    group.start()
    try:
        oracle = Oracle(tiny_model_dir)
        group.wait_ready()
        yield Env(lab, group, oracle, rss_of(group))
    finally:
        group.stop()


def run_fault(env: Env, name: str, fault, *, streams: Streams, join_s: float = 240) -> dict:
    """Streams start, the fault runs once every stream has a token (``fault()`` returns when the link is whole
    again), the streams end; returns the figures."""
    recoveries0 = env.metric("mmcast_worker_group_recoveries_total")
    slow0 = env.slow_steps()
    wall0 = time.time()
    streams.start()
    streams.wait_tokens(1)
    t0 = time.monotonic()
    fault()
    healed = time.monotonic()
    streams.join(join_s)
    wrong = streams.wrong()
    failed = streams.failures()
    figures = streams.figures(
        fault_s=healed - t0,
        resumed_after_heal_s=streams.resumed_after(healed),
        completed_after_heal_s=max(d[-1][0] for d in streams.deltas if d) - healed,
        recoveries=env.metric("mmcast_worker_group_recoveries_total") - recoveries0,
        steps_over_1s=env.slow_steps() - slow0,
    )
    report(name, **figures)
    assert not wrong, f"{name}: wrong tokens: {wrong}"
    figures["failures"], figures["wall0"] = failed, wall0
    return figures


# -- short: in make test ----------------------------------------------------------------------------------------------
def test_one_way_partition_scheduler_to_rank_below_the_step_deadline(env):
    """The scheduler's packets to rank 1 vanish for 2 s (rank 1's still arrive): TCP retransmits, the step is late
    but within the deadline; every stream completes equal to the oracle, with no recovery."""
    streams = env.traffic()
    figures = run_fault(
        env, "partition_sched_rank1_2s_one_way", lambda: _for(2.0, env.lab.drop, env.sched, env.rank1), streams=streams
    )
    assert not figures["failures"], figures["failures"]
    assert figures["recoveries"] == 0
    assert figures["steps_over_1s"] >= 1, "the fault left no trace in mmcast_step_seconds"
    env.check_after(streams, "2 s one-way partition")


def test_collective_link_cut_while_the_step_streams_stay_up(env):
    """Rank 0 and rank 1 cannot reach each other for 2 s (their gloo sockets), while both still talk to the
    scheduler: the collective waits, resumes when the link returns, and every stream completes correctly."""
    streams = env.traffic()
    figures = run_fault(
        env, "cut_rank0_rank1_2s", lambda: _for(2.0, env.lab.cut, env.rank0, env.rank1), streams=streams
    )
    assert not figures["failures"], figures["failures"]
    assert figures["steps_over_1s"] >= 1, "the fault left no trace in mmcast_step_seconds"
    env.check_after(streams, "collective link cut 2 s")


def test_a_1_mbit_scheduler_link_while_new_1280x720_images_travel(env):
    """tbf at 1 Mbit/s on what the scheduler sends while two new 1280x720 images (140 KB JPEG each, 1196 image
    tokens) go to the group: the encoded files cross the slow link (~1 s each) well within the step deadline, and
    both requests complete equal to the oracle."""
    figures = slow_link(env, "rate_1mbit_sched_out_new_1280x720_encoded", env.sched, "out")
    assert not figures["failures"], figures["failures"]


def slow_link(env: Env, name: str, node, direction: str, n: int = 2) -> dict:
    """``n`` new 1280x720 images sent while ``node``'s link runs at 1 Mbit/s (``direction``); the requests end
    (completed, or failed naming the cause), their streamed tokens are the oracle's, the group serves afterwards."""
    env.group.wait_ready(240)
    big = env.fresh(n, size=(1280, 720))
    for p in big:
        env.oracle(p, 8)
    streams = Streams(env.group.target, big, env.oracle, 8)
    recoveries0 = env.metric("mmcast_worker_group_recoveries_total")
    before = env.lab.link_stats(node)
    env.lab.rate_limit(node, "1mbit", direction)
    try:
        t0 = time.monotonic()
        streams.start()
        streams.join(300)
        took = time.monotonic() - t0
    finally:
        env.lab.unlimit(node)
    after = env.lab.link_stats(node)
    moved = {k: after[k] - before[k] for k in ("rx_bytes", "tx_bytes")}
    figures = report(
        name,
        **streams.figures(
            seconds=took,
            link_bytes=moved,
            recoveries=env.metric("mmcast_worker_group_recoveries_total") - recoveries0,
        ),
    )
    assert not streams.wrong(), streams.wrong()
    for i, why in streams.failures().items():  # only the step deadline may end one, and it must say so
        assert "--step-timeout-seconds" in why, f"request {i}: {why}"
    env.check_after(streams, name)
    figures["failures"] = streams.failures()
    return figures


def test_no_namespace_of_a_closed_lab_is_left():
    """A lab's close() removes its namespaces and kills what ran inside, even a process still running."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    lab = NetLab()
    node = lab.node("x")
    proc = lab.exec(node, ["sleep", "600"])
    names = {lab.hub, node.netns}
    assert names <= set(lab_namespaces())
    lab.close()
    assert proc.wait(10) is not None
    assert not names & set(lab_namespaces())


def test_a_killed_run_leaves_nothing_behind():
    """A run killed with SIGKILL (no atexit, no finalizer) leaves its namespaces; the next lab removes them, and
    what still ran inside them."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    code = (
        "import sys, time\n"
        "from tests.support.netlab import NetLab\n"
        "lab = NetLab(); node = lab.node('x'); lab.exec(node, ['sleep', '600'])\n"
        "print(lab.tag, flush=True); time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    tag = proc.stdout.readline().strip()
    assert tag, "the child made no lab"
    inside = subprocess.run(["ip", "netns", "pids", f"{tag}-x"], capture_output=True, text=True).stdout.split()
    proc.kill()
    proc.wait(10)
    assert [n for n in lab_namespaces(proc.pid) if n.startswith(tag)]  # left behind by the killed run
    NetLab().close()  # a new lab cleans up the runs whose process is gone
    assert not lab_namespaces(proc.pid)
    assert inside and not any(pid_alive(int(pid)) for pid in inside), "a process of the lab survived"


# -- long: make chaos -------------------------------------------------------------------------------------------------
@pytest.mark.chaos
def test_partition_scheduler_rank_past_the_step_deadline(env):
    """Scheduler and rank 1 cut apart (both ways) for 30 s, past the step deadline: the scheduler declares the
    group lost (logged with the cause), rank 0 leaves the collective its peer never joins, the group restarts,
    the scheduler reconnects once the link is back, and every stream completes correctly within the group
    deadline (or fails naming it)."""
    streams = env.traffic()
    figures = run_fault(
        env, "partition_sched_rank1_30s", lambda: _for(30.0, env.lab.cut, env.sched, env.rank1), streams=streams
    )
    for i, why in figures["failures"].items():
        assert "UNAVAILABLE" in why and "--group-deadline-seconds" in why, f"stream {i}: {why}"
    assert figures["recoveries"] >= 1
    lost = [r for r in env.log_lines("scheduler", figures["wall0"]) if r.get("msg", "").startswith("worker group lost")]
    assert lost, "the scheduler logged no lost group"
    env.check_after(streams, "30 s partition")


@pytest.mark.chaos
def test_an_idle_group_partitioned_is_found_by_its_keepalives(env):
    """Rank 1's link down for 15 s while the group is idle: no step is in flight to miss a deadline, so only the
    keepalives can tell the streams are half-open. The scheduler declares the group lost naming them, reconnects
    once the link is back, and new requests are answered equal to the oracle."""
    env.group.wait_ready(240)
    assert wait_until(env.idle, 60)
    recoveries0 = env.metric("mmcast_worker_group_recoveries_total")
    wall0 = time.time()
    t0 = time.monotonic()
    env.lab.partition(env.rank1)
    try:

        def found() -> bool:
            lost = [r for r in env.log_lines("scheduler", wall0) if r.get("msg", "").startswith("worker group lost")]
            return any("keepalives unanswered" in r["msg"] for r in lost)

        assert wait_until(found, 30, 0.2), "the scheduler did not notice the half-open streams"
        detected = time.monotonic() - t0
        time.sleep(max(0.0, 15.0 - detected))
    finally:
        env.lab.heal(env.rank1)
    healed = time.monotonic()
    env.group.wait_ready(240)
    back = time.monotonic() - healed
    streams = env.traffic()
    streams.start()
    streams.join(240)
    figures = report(
        "idle_group_rank1_partitioned_15s",
        **streams.figures(
            detected_after_s=detected,
            serving_after_heal_s=back,
            recoveries=env.metric("mmcast_worker_group_recoveries_total") - recoveries0,
        ),
    )
    assert not streams.failures() and not streams.wrong(), (streams.failures(), streams.wrong())
    assert figures["recoveries"] >= 1
    env.check_after(streams, "idle group partitioned")


@pytest.mark.chaos
def test_collective_link_cut_past_the_group_timeout(env):
    """The ranks' link cut for 15 s (past the step deadline and the ranks' group timeout) while the step streams
    stay up: the ranks end their collective, the group restarts, the streams complete correctly."""
    streams = env.traffic()
    figures = run_fault(
        env, "cut_rank0_rank1_15s", lambda: _for(15.0, env.lab.cut, env.rank0, env.rank1), streams=streams
    )
    assert not figures["failures"], figures["failures"]
    env.check_after(streams, "collective link cut 15 s")


@pytest.mark.chaos
def test_a_1_mbit_link_to_a_rank_carrying_its_collective_too(env):
    """tbf at 1 Mbit/s both ways on rank 1's link while new 1280x720 images are prefilled: besides the files, every
    all-reduce of a 1196-token prefill (~0.6 MB each, several per step) crosses it, so a step can outlast the
    deadline; each request completes equal to the oracle or fails naming --step-timeout-seconds, and the group
    serves correctly afterwards."""
    slow_link(env, "rate_1mbit_rank1_both_new_1280x720_encoded", env.rank1, "both")


@pytest.mark.chaos
def test_a_flapping_link(env):
    """Rank 1's link down and up every second for 20 s while streams start throughout (one a second): every
    stream completes correctly or fails naming the cause, and the group serves correctly afterwards."""
    streams = env.traffic(n_new=10, n_cached=10)
    recoveries0 = env.metric("mmcast_worker_group_recoveries_total")
    downs: list[int] = []
    flapper = threading.Thread(target=lambda: downs.append(env.lab.flap(env.rank1, 20.0)), daemon=True)
    t0 = time.monotonic()
    flapper.start()
    streams.start(stagger=1.0)
    flapper.join(60)
    healed = time.monotonic()
    streams.join(240)
    report(
        "flap_rank1_20s",
        **streams.figures(
            fault_s=healed - t0,
            downs=downs[0] if downs else None,
            completed_after_heal_s=max(d[-1][0] for d in streams.deltas if d) - healed,
            recoveries=env.metric("mmcast_worker_group_recoveries_total") - recoveries0,
        ),
    )
    assert not streams.wrong(), streams.wrong()
    for i, why in streams.failures().items():
        assert "UNAVAILABLE" in why, f"stream {i}: {why}"
    env.check_after(streams, "flapping link")


def _for(seconds: float, fault, *nodes) -> None:
    """``fault(*nodes)`` for ``seconds``, then undone (``drop``→``undrop``, ``cut``→``mend``)."""
    undo = {"drop": "undrop", "cut": "mend", "partition": "heal"}[fault.__name__]
    fault(*nodes)
    try:
        time.sleep(seconds)
    finally:
        getattr(fault.__self__, undo)(*nodes)
