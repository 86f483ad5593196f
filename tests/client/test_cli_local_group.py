"""LocalGroup and `mmcast serve-local` supervision, with stand-in processes instead of the real services.

The stand-in scheduler serves the fake Generation service and gRPC health on the --listen address it is given;
the stand-in worker prints its flags and sleeps. That is enough to check ports and flags, readiness polling, group
restarts, clean stops and that no child outlives a killed supervisor.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from common.process import EXIT_STARTUP_FAILURE
from mmcast_client import Client
from mmcast_local.supervisor import LocalGroup, StartupFailure, ready_line

FAKE_SCHEDULER = textwrap.dedent(
    """
    import argparse, signal, sys, threading
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from mmcast.v1 import generation_pb2_grpc
    from mmcast_client.testing import FakeGenerationServicer

    parser = argparse.ArgumentParser()
    parser.add_argument("--listen")
    args, _ = parser.parse_known_args()
    print("argv", " ".join(sys.argv[1:]), flush=True)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    generation_pb2_grpc.add_GenerationServiceServicer_to_server(FakeGenerationServicer(), server)
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    server.add_insecure_port(args.listen)
    server.start()
    checker.set("mmcast.v1.GenerationService", health_pb2.HealthCheckResponse.SERVING)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(0)
    """
)
FAKE_WORKER = textwrap.dedent(
    """
    import argparse, signal, sys, threading
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    parser = argparse.ArgumentParser()
    parser.add_argument("--listen")
    args, _ = parser.parse_known_args()
    print("argv", " ".join(sys.argv[1:]), flush=True)
    server = grpc.server(futures.ThreadPoolExecutor(2))
    checker = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    server.add_insecure_port(args.listen)
    server.start()
    checker.set("mmcast.v1.WorkerService", health_pb2.HealthCheckResponse.SERVING)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    stop.wait()
    server.stop(0)
    """
)


@pytest.fixture
def stand_ins(tmp_path):
    scheduler = tmp_path / "fake_scheduler.py"
    worker = tmp_path / "fake_worker.py"
    scheduler.write_text(FAKE_SCHEDULER)
    worker.write_text(FAKE_WORKER)
    return [sys.executable, str(scheduler)], [sys.executable, str(worker)]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def last_argv(path) -> str:
    return [line for line in path.read_text().splitlines() if line.startswith("argv ")][-1]


def group(stand_ins, tmp_path, **kwargs) -> LocalGroup:
    scheduler, worker = stand_ins
    return LocalGroup(
        tmp_path / "model",
        kwargs.pop("tp", 2),
        "strip",
        scheduler_command=scheduler,
        worker_command=worker,
        log_dir=tmp_path / "logs",
        ready_timeout=30,
        grace_seconds=2,
        kv_blocks=64,
        **kwargs,
    )


def test_flags_readiness_and_clean_stop(stand_ins, tmp_path):
    with group(stand_ins, tmp_path, scheduler_args=["--max-num-seqs", "4"]) as g:
        with Client(g.target) as client:
            assert client.get_server_info().group_ready
            assert len(client.generate("hi", max_tokens=3).token_ids) == 3
        pids = g.pids()
        assert all(alive(pid) for pid in pids.values())
        rank1 = last_argv(g.log_dir / "rank1.log")
        assert f"--rank 1 --world-size 2 --listen {g.worker_targets[1]} --dist-init tcp://127.0.0.1:" in rank1
        assert f"--model {tmp_path / 'model'}" in rank1 and "--kv-blocks 64" in rank1
        assert f"--metrics-port {g.metrics_urls['rank1'].rsplit(':', 1)[1].split('/')[0]}" in rank1
        sched = last_argv(g.log_dir / "scheduler.log")
        # the Step streams on the ranks' Unix-domain sockets, in the group's 0700 secret folder
        sockets = [g.step_socket(r) for r in range(2)]
        assert f"--listen {g.target}" in sched and f"--workers local:{sockets[0]},local:{sockets[1]}" in sched
        assert f"--step-socket {sockets[1]}" in rank1 and os.path.dirname(sockets[1]) == str(g.token_file.parent)
        assert "--transfer-mode strip" in sched and sched.endswith("--max-num-seqs 4")
        line = ready_line(g)
        described = json.loads(line.removeprefix("READY "))
        assert described["target"] == g.target and set(described["metrics"]) == {"scheduler", "rank0", "rank1"}
        assert (
            len({g.port, *g.worker_ports, *[int(u.split(":")[2].split("/")[0]) for u in g.metrics_urls.values()]}) == 6
        )
    assert wait_until(lambda: not any(alive(pid) for pid in pids.values()), 5)


def test_a_per_group_secret_and_loopback_binding_are_passed_to_every_child(stand_ins, tmp_path):
    with group(stand_ins, tmp_path) as g, group(stand_ins, tmp_path / "other") as other:
        secret = g.token_file
        assert os.stat(secret).st_mode & 0o777 == 0o600 and os.stat(secret.parent).st_mode & 0o777 == 0o700
        token = secret.read_text().strip()
        assert len(token) >= 32 and token != other.token_file.read_text().strip()  # one secret per group
        sched = last_argv(g.log_dir / "scheduler.log")
        assert f"--worker-token-file {secret}" in sched and "--metrics-host 127.0.0.1" in sched
        for r in range(2):
            rank = last_argv(g.log_dir / f"rank{r}.log")
            assert f"--shared-token-file {secret}" in rank
            assert "--metrics-host 127.0.0.1 --dist-bind-host 127.0.0.1" in rank
        assert token not in (g.log_dir / "scheduler.log").read_text()  # a path on the command line, not the token
        assert g.env["GLOO_SOCKET_IFNAME"] == "lo"
    assert not secret.exists() and not secret.parent.exists()


def test_a_dead_rank_restarts_the_whole_group_with_a_fresh_dist_port(stand_ins, tmp_path):
    with group(stand_ins, tmp_path) as g:
        before = g.pids()
        dist_before = re.search(r"--dist-init (\S+)", last_argv(g.log_dir / "rank0.log")).group(1)
        generation = g.kill_rank(1)
        g.wait_restarted(generation, timeout=20)
        after = g.pids()
        assert after["scheduler"] == before["scheduler"]  # the scheduler reconnects by itself
        assert after["rank0"] != before["rank0"] and after["rank1"] != before["rank1"]
        assert not alive(before["rank0"]) and not alive(before["rank1"])
        assert wait_until(lambda: (g.log_dir / "rank0.log").read_text().count("\nargv ") == 2)
        dist_after = re.search(r"--dist-init (\S+)", last_argv(g.log_dir / "rank0.log")).group(1)
        assert dist_after != dist_before and g.restarts == 1
        assert f"--listen {g.worker_targets[0]}" in last_argv(g.log_dir / "rank0.log")  # same gRPC port


def test_a_dead_scheduler_is_restarted_alone(stand_ins, tmp_path):
    with group(stand_ins, tmp_path, tp=1) as g:
        before = g.pids()
        os.kill(before["scheduler"], signal.SIGKILL)
        assert wait_until(lambda: g.pids()["scheduler"] != before["scheduler"])
        g.wait_ready(20)
        assert g.pids()["rank0"] == before["rank0"] and g.restarts == 1


def test_ready_waits_for_every_rank(stand_ins, tmp_path):
    scheduler, _ = stand_ins
    g = group((scheduler, [sys.executable, "-c", "import time; time.sleep(60)"]), tmp_path, tp=1)
    g.start()
    try:
        with pytest.raises(TimeoutError, match="mmcast.v1.WorkerService at 127.0.0.1:"):
            g.wait_ready(1.5)
    finally:
        g.stop()


def test_gives_up_after_too_many_restarts(stand_ins, tmp_path):
    scheduler, _ = stand_ins
    g = group((scheduler, [sys.executable, "-c", "raise SystemExit(3)"]), tmp_path, tp=1, max_restarts=2)
    g.start()
    try:
        with pytest.raises(RuntimeError, match="gave up after 2 restarts"):
            g.wait_ready(20)
    finally:
        g.stop()


# A rank that refuses to start as the real ones do (common.process.startup_failure): one JSON record marked
# startup_failure, then EXIT_STARTUP_FAILURE. Only rank 1 refuses; rank 0 would serve.
REFUSING_WORKER = textwrap.dedent(
    """
    import json, sys, time
    from common.process import EXIT_STARTUP_FAILURE
    if "--rank 1 " not in " ".join(sys.argv) + " ":
        time.sleep(60)
    print(json.dumps({"level": "critical", "msg": "--world-size 2: the cause, in one line", "startup_failure": True}),
          file=sys.stderr, flush=True)
    sys.exit(EXIT_STARTUP_FAILURE)
    """
)


def test_a_start_up_failure_stops_the_group_at_once_with_its_cause(stand_ins, tmp_path):
    scheduler, _ = stand_ins
    g = group((scheduler, [sys.executable, "-c", REFUSING_WORKER]), tmp_path)
    g.start()
    try:
        rank0 = g.pids()["rank0"]
        started = time.monotonic()
        with pytest.raises(StartupFailure) as info:
            g.wait_ready(30)
        assert str(info.value) == "rank1 could not start: --world-size 2: the cause, in one line"
        assert time.monotonic() - started < 10 and g.restarts == 0 and g.startup_failed
        assert wait_until(lambda: not alive(rank0), 10)  # the whole group stopped, not only the refusing rank
    finally:
        g.stop()


def test_a_scheduler_flag_error_stops_the_group_with_argparse_s_line(stand_ins, tmp_path):
    _, worker = stand_ins
    refusing = (  # what argparse does with a bad flag
        "import sys; print('usage: mmcast-scheduler [-h] ...', file=sys.stderr); "
        "print('mmcast-scheduler: error: bad --max-num-seqs', file=sys.stderr); sys.exit(2)"
    )
    g = group(([sys.executable, "-c", refusing], worker), tmp_path)
    g.start()
    try:
        with pytest.raises(StartupFailure, match=r"^scheduler could not start: mmcast-scheduler: error: bad --max"):
            g.wait_ready(30)
        assert g.restarts == 0
    finally:
        g.stop()


def test_serve_local_prints_the_cause_of_a_start_up_failure_as_one_line(stand_ins, tmp_path, monkeypatch, capsys):
    from mmcast_client import cli

    scheduler, _ = stand_ins
    monkeypatch.setenv("MMCAST_SCHEDULER_COMMAND", " ".join(scheduler))
    monkeypatch.setenv("MMCAST_WORKER_COMMAND", f"{sys.executable} -c '{REFUSING_WORKER}'")
    code = cli.main(["serve-local", "--model", str(tmp_path), "--tp", "2", "--port", "0", "--log-dir", str(tmp_path)])
    assert code == EXIT_STARTUP_FAILURE
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "error: rank1 could not start: --world-size 2: the cause, in one line"
    assert len(err) == 2 and err[0].startswith("starting 1 scheduler + 2 worker rank(s)")


def test_real_processes_refusing_a_folder_without_config_json_stop_the_group(tmp_path):
    """The real mmcast-worker and mmcast-scheduler: no restarts, the rank's own one-line cause."""
    g = LocalGroup(tmp_path / "empty", 2, "lazy", log_dir=tmp_path / "logs", ready_timeout=60, grace_seconds=2)
    g.start()
    try:
        with pytest.raises(StartupFailure) as info:
            g.wait_ready()
        assert re.fullmatch(r"(rank[01]|scheduler) could not start: --model \S+/empty: not a model folder \(no config.json\)",
                            str(info.value)), str(info.value)  # fmt: skip
        assert g.restarts == 0
    finally:
        g.stop()


SUPERVISOR = textwrap.dedent(
    """
    import json, sys, time
    from mmcast_local.supervisor import LocalGroup
    g = LocalGroup(sys.argv[1], 2, "lazy", scheduler_command=[sys.executable, sys.argv[2]],
                   worker_command=[sys.executable, sys.argv[3]], log_dir=sys.argv[4])
    g.start()
    g.wait_ready(30)
    print(json.dumps(g.pids()), flush=True)
    time.sleep(3600)
    """
)


def test_no_orphans_when_the_supervisor_is_killed(stand_ins, tmp_path):
    (_, scheduler), (_, worker) = stand_ins
    proc = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, str(tmp_path), scheduler, worker, str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = json.loads(proc.stdout.readline())
        assert all(alive(pid) for pid in pids.values())
        proc.kill()  # SIGKILL: no handler, no cleanup code runs in the supervisor
        proc.wait()
        assert wait_until(lambda: not any(alive(pid) for pid in pids.values()), 10), pids
    finally:
        proc.kill()


def test_serve_local_prints_ready_and_stops_on_sigterm(stand_ins, tmp_path):
    scheduler, worker = stand_ins
    env = dict(
        os.environ,
        MMCAST_SCHEDULER_COMMAND=" ".join(scheduler),
        MMCAST_WORKER_COMMAND=" ".join(worker),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmcast_client.cli", "serve-local", "--model", str(tmp_path), "--tp", "2",
         "--port", "0", "--http-port", "0", "--log-dir", str(tmp_path / "logs"), "--", "--max-num-seqs", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY "):
                break
        ready = json.loads(lines[-1].removeprefix("READY "))
        assert any(line.startswith("scheduler  grpc://") for line in lines)
        assert any("metrics" in line and "/metrics" in line for line in lines)
        with Client(ready["target"]) as client:
            assert client.generate("x", max_tokens=2).finish_reason == "length"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert not any(alive(pid) for pid in ready["pids"].values())
        sched = last_argv(tmp_path / "logs" / "scheduler.log")
        assert "--max-num-seqs 8" in sched
        http_port = int(ready["openai_base_url"].removeprefix("http://127.0.0.1:").removesuffix("/v1"))
        assert f"--http-port {http_port}" in sched and 0 < http_port != int(ready["target"].rsplit(":", 1)[1])
    finally:
        proc.kill()
