"""Scheduler recovery against recording fake ranks (in-process, port 0): a rank that misses the step deadline is
dropped with its stream, and the recovered requests reach the ranks only on a fresh stream under a newer epoch,
never on the stream whose state the ranks still hold."""

from __future__ import annotations

import threading
import time

import pytest

from mmcast.v1 import worker_pb2
from mmcast_client import Client
from tests.support.fake_rank import expected_tokens
from tests.support.service_harness import FakeGroupScheduler


@pytest.fixture
def harness(tiny_model_dir, request):
    h = FakeGroupScheduler(tiny_model_dir, **request.param).start()
    yield h
    h.stop()


def stream_log(rank) -> list[tuple[str, object]]:
    """The rank's frames in arrival order: ("handshake", epoch) or ("control", StepControl)."""
    out = []
    for raw in rank.frames:
        frame = worker_pb2.StepRequest.FromString(raw)
        kind = frame.WhichOneof("frame")
        if kind == "handshake":
            out.append(("handshake", frame.handshake.scheduler_epoch))
        elif kind == "control":
            out.append(("control", frame.control))
    return out


def assert_recovery_steps_open_fresh_streams(rank) -> None:
    """Every reset step (the first plan after a recovery) is the first control of a stream opened under a newer
    epoch: the ranks never receive recovered requests on the stream of the step that was lost."""
    log = stream_log(rank)
    epochs = [e for kind, e in log if kind == "handshake"]
    assert epochs == sorted(set(epochs)), f"rank {rank.cfg.rank}: epochs not strictly increasing: {epochs}"
    for i, (kind, item) in enumerate(log):
        if kind == "control" and item.reset_caches:
            assert i > 0 and log[i - 1][0] == "handshake", (
                f"rank {rank.cfg.rank}: reset step {item.step_id} sent on a stream that already carried step "
                f"{log[i - 1][1].step_id if log[i - 1][0] == 'control' else '?'}"
            )


def prompt_of(h, request_id: str) -> list[int]:
    for kind, item in stream_log(h.ranks[0]):
        if kind == "control":
            for req in item.new_requests:
                if req.request_id == request_id and req.num_output_tokens == 0:
                    return list(req.prompt_token_ids)
    raise AssertionError(f"{request_id} never admitted")


@pytest.mark.parametrize(
    "harness",
    [{"rank_kw": {"step_delay": 0.005}, "step_timeout_seconds": 0.5, "reconnect_backoff_initial_seconds": 0.05}],
    indirect=True,
)
def test_a_step_past_the_deadline_drops_the_stream_and_recovers_on_a_newer_epoch(harness):
    """--step-timeout-seconds reaches the group; the stalled stream is closed before the recovered step is sent."""
    h = harness
    stalled = h.ranks[1]
    result: dict = {}

    def client() -> None:
        with Client(h.target, timeout=60) as c:
            result["r"] = c.generate("Count slowly.", max_tokens=40, ignore_eos=True, request_id="stall-1")

    thread = threading.Thread(target=client)
    thread.start()
    deadline = time.monotonic() + 20
    while stalled.steps_answered < 10 and time.monotonic() < deadline:
        time.sleep(0.005)
    stalled.cfg.step_delay = 2.0  # the next step sleeps 2 s on this rank: 4x the step deadline
    time.sleep(0.3)
    stalled.cfg.step_delay = 0.005
    thread.join(60)
    assert "r" in result, "the request did not finish"
    assert h.server.metrics.group_recoveries._value.get() >= 1
    assert all(len(r.handshakes) >= 2 for r in h.ranks)  # reconnected under a newer epoch
    for rank in h.ranks:
        assert_recovery_steps_open_fresh_streams(rank)
    assert list(result["r"].token_ids) == expected_tokens(prompt_of(h, "stall-1"), 40)  # no repeats, no gaps


def test_a_rank_that_comes_back_is_reached_at_the_next_attempt():
    """The engine paces reconnects itself (--reconnect-backoff-*). gRPC's own per-address reconnect backoff,
    shared by every channel to that address, must not add to it: after a long outage it had grown to ~10 s, and
    the scheduler kept failing with 'Connection refused' long after the restarted ranks were serving."""
    import asyncio

    import grpc

    from mmcast_local.child_processes import free_ports
    from scheduler_svc.transport.rank_streams import GroupDown, WorkerGroup
    from tests.support.fake_rank import FakeRank, FakeRankConfig

    fp = "f" * 64
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"

    async def body():
        group = WorkerGroup([address], model_fingerprint=fp, block_size=16, handshake_timeout=2.0)
        for _ in range(3):  # the rank is down: every attempt fails
            with pytest.raises(GroupDown):
                await group.connect()
        rank = FakeRank(FakeRankConfig(rank=0, world_size=1, fingerprint=fp))
        handler = grpc.stream_stream_rpc_method_handler(rank._step, request_deserializer=None, response_serializer=None)
        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("mmcast.v1.WorkerService", {"Step": handler})]
        )
        assert server.add_insecure_port(address) == port
        await server.start()
        try:
            budget = await group.connect()  # the rank is back: the very next attempt reaches it
            assert budget.num_ranks == 1
        finally:
            await group.close()
            await server.stop(None)

    asyncio.run(body())


def test_a_step_whose_payload_cannot_be_written_fails_at_the_step_deadline():
    """A rank whose link stops taking bytes (a partition, a very slow link) while a step's payload is written: the
    write waits on gRPC flow control. The step deadline covers the writes too, so the group is declared lost at the
    deadline (naming the flag) instead of the engine waiting as long as the link stays broken."""
    import asyncio

    import torch

    from mmcast.v1 import worker_pb2
    from scheduler_svc.transport.rank_streams import GroupDown, PayloadTensors, WorkerGroup
    from tests.support.fake_rank import FakeRank, FakeRankConfig

    fp = "f" * 64

    async def body():
        rank = FakeRank(FakeRankConfig(rank=0, world_size=1, fingerprint=fp))
        await rank.start()
        group = WorkerGroup([rank.address], model_fingerprint=fp, block_size=16, step_timeout=0.5)
        try:
            await group.connect()
            stream = group._streams[0]

            async def stuck(raw: bytes) -> None:  # what a write into a partitioned link does
                await asyncio.Event().wait()

            stream.call.write = stuck
            payload = [[PayloadTensors("item", [("pixel_values", torch.zeros(1024, 16))])]]
            t0 = time.monotonic()
            with pytest.raises(GroupDown, match="--step-timeout-seconds"):
                await asyncio.wait_for(group.run_step(1, worker_pb2.StepControl(step_id=1), payload), 10)
            assert time.monotonic() - t0 < 5
        finally:
            await group.close()
            await rank.stop()

    asyncio.run(body())
