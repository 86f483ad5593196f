"""Who may drive a rank, against real processes: stray peers, foreign KV blocks, desynchronised streams, sockets.

- A standalone ``mmcast-worker`` (shared token): a peer without credentials claiming the largest epoch gets
  UNAUTHENTICATED and learns nothing about the rank, after which an authenticated handshake still succeeds; an
  authenticated stream naming, as its computed prefix, blocks another stream wrote, blocks it assigned but never
  wrote, or blocks never assigned is refused (no token or log-probability comes back) while prefix sharing within
  the stream keeps working; a handshake refused with no stream active turns the rank's readiness NOT_SERVING.
- ``serve-local`` at TP=2 (``LocalGroup``: scheduler + two ranks): every listening socket of every child is on
  loopback; two desynchronised streams without credentials to the two ranks are refused, the scheduler keeps
  serving and no process restarts; after a stray max-epoch handshake, a restarted scheduler connects again.
"""

from __future__ import annotations

import itertools
import os
import signal
import time

import psutil
import pytest

from common.item_proto import PROTOCOL_VERSION
from mmcast.v1 import worker_pb2
from mmcast_client import Client
from tests.support import security_catalogue as cat
from tests.support.security_support import WorkerProcess, new_token, secret_file, serving, wait_for

pytestmark = pytest.mark.slow

MAX_EPOCH = 2**64 - 1
WORKER_SERVICE = "mmcast.v1.WorkerService"


@pytest.fixture(scope="module")
def rank(tiny_model_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("rank-streams")
    token = new_token()
    secret_file(folder / "worker-token", token + "\n")
    process = WorkerProcess(
        tiny_model_dir,
        folder / "rank.log",
        [
            "--shared-token-file",
            str(folder / "worker-token"),
            "--kv-blocks",
            "64",
            "--scheduler-id",
            cat.WORKER_LIMITS["--scheduler-id"],
        ],
    )
    epochs = itertools.count(time.time_ns())
    ctx = cat.StepCtx(process.target, token, tiny_model_dir, 1024, lambda: next(epochs))
    try:
        process.wait_ready()
        yield process, ctx
    finally:
        ctx.close_all()
        process.stop()


def new_request(rid: str, n: int, blocks: list[int], computed: int = 0) -> worker_pb2.NewRequest:
    return cat.text_request(rid, n=n, block_ids=blocks, num_computed_tokens=computed, num_scheduled_tokens=n - computed)


def step(stream, step_id: int, *requests) -> tuple[str, str, worker_pb2.StepResponse | None]:
    return stream.send(cat.control(step_id, new_requests=list(requests))).answer()


def test_no_credentials_and_the_largest_epoch_get_unauthenticated_and_learn_nothing(rank):
    process, ctx = rank
    stray = ctx.stream(metadata=()).send(ctx.handshake(scheduler_epoch=MAX_EPOCH))
    code, message, _ = stray.answer()
    assert code == "UNAUTHENTICATED", (code, message)
    for secret in (ctx.fingerprint, ctx.fingerprint[:12], cat.WORKER_LIMITS["--scheduler-id"], "rank", "epoch"):
        assert secret not in message, message
    # The epoch was never read: an authenticated scheduler with an ordinary epoch is served.
    s = ctx.open()
    assert step(s, 1, new_request("after-stray", 8, [0]))[0] == "OK"
    s.close()
    assert serving(process.target, WORKER_SERVICE) and process.process.poll() is None


def test_a_prefix_may_name_only_blocks_its_own_stream_wrote(rank):
    process, ctx = rank
    a = ctx.open()
    code, _, first = step(a, 1, new_request("a1", 40, [10, 11, 12]))  # writes blocks 10 and 11
    assert code == "OK"
    # Prefix sharing inside the stream: the same prompt from the written blocks gives the same greedy token.
    code, message, reused = step(a, 2, new_request("a2", 40, [10, 11, 13], computed=32))
    assert code == "OK", message
    assert reused.step_result.sampled[0].token_id == first.step_result.sampled[0].token_id

    def refused(stream, blocks, computed, index, block, steps=()):
        for n, req in enumerate(steps, 1):
            assert step(stream, n, req)[0] == "OK"
        code, message, frame = step(stream, len(steps) + 1, new_request("probe", computed + 8, blocks, computed))
        assert code == "ProtocolError.STATE_MISMATCH", (code, message)
        assert f"new_requests[probe].block_ids[{index}]={block}" in message
        assert "no request of this stream wrote" in message
        assert frame.WhichOneof("frame") == "error" and frame.error.request_id == "probe"
        assert stream.answer()[0] != "OK"  # the stream ends; no StepResult (no token, no logprob) follows

    refused(ctx.open(), [10, 11, 14], 32, 0, 10)  # written by stream a (superseded now)
    refused(ctx.open(), [50, 51, 52], 32, 0, 50)  # never assigned by anyone
    # Assigned by this stream to a request that never filled it: its pool rows are another stream's.
    refused(ctx.open(), [20, 21], 16, 0, 20, steps=[new_request("partial", 8, [20])])
    # Written by this stream, then one foreign block behind it.
    refused(ctx.open(), [30, 12], 32, 1, 12, steps=[new_request("own", 20, [30, 31])])
    ctx.close_all()
    s = ctx.open()  # the rank keeps serving
    assert step(s, 1, new_request("fine", 8, [0]))[0] == "OK"
    s.close()
    assert process.process.poll() is None


def test_readiness_is_not_serving_while_the_schedulers_handshake_is_refused(rank):
    """Runs last on this rank: the largest epoch locks every smaller one out for the life of the process."""
    process, ctx = rank
    active = ctx.open()
    stale = ctx.stream().send(ctx.handshake(scheduler_epoch=1)).answer()
    assert stale[0] == "FAILED_PRECONDITION" and "not newer than the active" in stale[1]
    assert serving(process.target, WORKER_SERVICE)  # a stream is active: the rank is in use
    active.close()
    wait_for(lambda: not serving(process.target, WORKER_SERVICE), 10, "readiness should drop: last handshake refused")
    ctx.open().close()  # the scheduler reconnects: ready again
    wait_for(lambda: serving(process.target, WORKER_SERVICE), 10, "readiness should return after an admitted handshake")
    # An authenticated peer that claims the largest epoch locks the scheduler out: the orchestrator sees it.
    ctx.open(scheduler_epoch=MAX_EPOCH).close()
    code, message = ctx.stream().send(ctx.handshake()).answer()[:2]
    assert code == "FAILED_PRECONDITION" and "stale scheduler" in message
    wait_for(lambda: not serving(process.target, WORKER_SERVICE), 10, "a locked-out rank must not report SERVING")
    assert serving(process.target, "")  # liveness is unaffected: the process itself is fine
    ctx.close_all()


# --- serve-local -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def group(serve_local_tp2):
    return serve_local_tp2  # shared with tests/client/test_cli_e2e.py (conftest.py)


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of ``pid`` and its descendants."""
    root = psutil.Process(pid)
    out = []
    for proc in [root, *root.children(recursive=True)]:
        for conn in proc.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                out.append((conn.laddr.ip, conn.laddr.port))
    return out


def test_serve_local_listens_on_loopback_only(group):
    ports = {}
    for name, pid in group.pids().items():
        ports[name] = listening(pid)
        outside = [(ip, port) for ip, port in ports[name] if ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
        assert not outside, f"{name} listens beyond loopback: {outside}"
    assert {group.port, group.http_port, group.metrics_ports[0]} <= {p for _, p in ports["scheduler"]}
    for r in range(group.tp):
        assert {group.worker_ports[r], group.metrics_ports[1 + r]} <= {p for _, p in ports[f"rank{r}"]}
    assert group.dist_port in {p for _, p in ports["rank0"]}  # the rendezvous store, bound to loopback too
    # The secret travels as a private file, never on a command line.
    token = group.token_file.read_text().strip()
    assert os.stat(group.token_file).st_mode & 0o777 == 0o600
    assert os.stat(group.token_file.parent).st_mode & 0o777 == 0o700
    for pid in group.pids().values():
        assert token not in " ".join(psutil.Process(pid).cmdline())


def test_stray_desynchronised_streams_are_refused_and_the_group_keeps_serving(group, tiny_model_dir):
    pids, restarts = group.pids(), group.restarts
    fingerprint = cat.StepCtx(group.worker_targets[0], "x" * 16, tiny_model_dir, 1024, lambda: 0).fingerprint
    streams, answers = [], []
    for r, target in enumerate(group.worker_targets):  # one epoch, two step ids: the old group-desync crash
        hs = worker_pb2.Handshake(
            protocol_version=PROTOCOL_VERSION,
            model_fingerprint=fingerprint,
            rank=r,
            world_size=2,
            scheduler_epoch=MAX_EPOCH,
            scheduler_id="mmcast-scheduler",
            block_size=16,
        )
        s = cat.Stream(target, ())
        s.send(worker_pb2.StepRequest(handshake=hs), cat.control(10 + r, new_requests=[cat.text_request()]))
        streams.append(s)
        answers.append(s.answer())
    for s in streams:
        s.close()
    assert [a[0] for a in answers] == ["UNAUTHENTICATED"] * 2, answers
    with Client(group.target) as client:
        reply = client.generate("still serving", max_tokens=4, ignore_eos=True)
        assert len(reply.token_ids) == 4
    assert group.pids() == pids and group.restarts == restarts


def test_a_restarted_scheduler_connects_after_a_stray_max_epoch(group):
    stray = cat.Stream(group.worker_targets[0], ())
    code = stray.send(worker_pb2.StepRequest(handshake=worker_pb2.Handshake(scheduler_epoch=MAX_EPOCH))).answer()[0]
    stray.close()
    assert code == "UNAUTHENTICATED"
    ranks_before = {k: v for k, v in group.pids().items() if k != "scheduler"}
    restarts = group.restarts
    os.kill(group.pids()["scheduler"], signal.SIGKILL)  # a fresh scheduler handshakes under a new epoch
    wait_for(lambda: group.restarts == restarts + 1, 30, "the scheduler was not restarted")
    group.wait_ready(120)
    with Client(group.target) as client:
        assert len(client.generate("after the restart", max_tokens=3, ignore_eos=True).token_ids) == 3
    assert {k: v for k, v in group.pids().items() if k != "scheduler"} == ranks_before
