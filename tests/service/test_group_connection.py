"""The scheduler's group connection against in-process fake ranks that record every byte."""

import asyncio

import pytest
import torch

from common import codec
from mmcast.v1 import worker_pb2
from scheduler_svc.transport.rank_streams import GroupDown, PayloadTensors, WorkerGroup
from tests.support.fake_rank import FakeRank, FakeRankConfig

FP = "f" * 64


async def start_ranks(n, **kw):
    ranks = [FakeRank(FakeRankConfig(rank=r, world_size=n, fingerprint=FP, **kw)) for r in range(n)]
    for r in ranks:
        await r.start()
    return ranks


def run(coro):
    return asyncio.run(coro)


def control_with_new_request(step_id=1):
    ctrl = worker_pb2.StepControl(step_id=step_id)
    ctrl.new_requests.add(request_id="r1", prompt_token_ids=list(range(40)), num_scheduled_tokens=40)
    return ctrl


def test_control_bytes_identical_across_ranks_and_payloads_only_where_needed():
    async def body():
        ranks = await start_ranks(3)
        group = WorkerGroup([r.address for r in ranks], model_fingerprint=FP, block_size=16, chunk_size=1 << 16)
        budget = await group.connect()
        assert budget.num_ranks == 3 and budget.kv_blocks == 256
        a = torch.randn(50_000)  # 200 KB -> 4 chunks of 64 KiB
        b = torch.randn(10)
        sends = [
            [PayloadTensors("item-a", [("pixel_values", a)]), PayloadTensors("item-b", [("pixel_values", b)])],
            [PayloadTensors("item-b", [("pixel_values", b)])],
            [],
        ]
        results = await group.run_step(1, control_with_new_request(), sends)
        assert [r.rank for r in results] == [0, 1, 2]
        assert len(results[0].sampled) == 1 and not results[1].sampled
        await group.close()
        for r in ranks:
            await r.stop()
        return ranks, group, a, b

    ranks, group, a, b = run(body())
    controls = [
        [f for f in r.frames if worker_pb2.StepRequest.FromString(f).WhichOneof("frame") == "control"] for r in ranks
    ]
    assert controls[0] == controls[1] == controls[2]  # byte-identical control on every rank
    frames_a = codec.payload_frames("item-a", "pixel_values", a, chunk_size=1 << 16)
    frames_b = codec.payload_frames("item-b", "pixel_values", b, chunk_size=1 << 16)
    payload = [
        [f for f in r.frames if worker_pb2.StepRequest.FromString(f).WhichOneof("frame") == "payload"] for r in ranks
    ]
    assert payload[0] == frames_a + frames_b
    assert payload[1] == frames_b
    assert payload[2] == []
    # payloads precede the control that consumes them
    last_payload = max(i for i, f in enumerate(ranks[0].frames) if f in payload[0])
    assert ranks[0].frames.index(controls[0][0]) > last_payload
    # the scheduler's counters equal what the ranks received, kind by kind
    received = {k: sum(r.bytes_by_kind[k] for r in ranks) for k in ("payload", "metadata", "control")}
    assert received == {
        "payload": group.bytes.payload,
        "metadata": group.bytes.metadata,
        "control": group.bytes.control,
    }
    assert group.bytes.payload == sum(map(len, frames_a)) + 2 * sum(map(len, frames_b))


def test_a_rank_demanding_a_token_refuses_a_group_without_it_before_any_frame():
    async def body():
        ranks = await start_ranks(1, token="t" * 32)
        bare = WorkerGroup([ranks[0].address], model_fingerprint=FP, block_size=16)
        with pytest.raises(GroupDown, match=r"UNAUTHENTICATED: missing 'authorization'.*--worker-token-file"):
            await bare.connect()
        wrong = WorkerGroup(
            [ranks[0].address],
            model_fingerprint=FP,
            block_size=16,
            call_metadata=[("authorization", "Bearer " + "u" * 32)],
        )
        with pytest.raises(GroupDown, match="UNAUTHENTICATED: the bearer token is not valid"):
            await wrong.connect()
        assert ranks[0].frames == []  # refused before the handshake was read
        good = WorkerGroup(
            [ranks[0].address],
            model_fingerprint=FP,
            block_size=16,
            call_metadata=[("authorization", "Bearer " + "t" * 32)],
        )
        await good.connect()
        assert len(ranks[0].handshakes) == 1
        await good.close()
        await ranks[0].stop()

    run(body())


def test_handshake_refusal_and_disagreement_raise_group_down():
    async def body():
        ranks = await start_ranks(2, refuse_handshake="model_fingerprint abc != def")
        group = WorkerGroup([r.address for r in ranks], model_fingerprint=FP, block_size=16)
        with pytest.raises(GroupDown, match="FAILED_PRECONDITION: model_fingerprint abc != def"):
            await group.connect()
        other = await start_ranks(2)
        other[1].cfg.world_size = 4
        group = WorkerGroup([r.address for r in other], model_fingerprint=FP, block_size=16)
        with pytest.raises(GroupDown, match=r"world_size 4 != 2"):
            await group.connect()
        swapped = WorkerGroup([other[1].address, other[0].address], model_fingerprint=FP, block_size=16)
        other[1].cfg.world_size = 2
        with pytest.raises(GroupDown, match=r"rank 1 != 0"):
            await swapped.connect()
        for r in ranks + other:
            await r.stop()

    run(body())


def test_dropped_stream_marks_group_down_and_reconnect_uses_newer_epoch():
    async def body():
        ranks = await start_ranks(2)
        ranks[1].cfg.drop_after_steps = 1
        group = WorkerGroup([r.address for r in ranks], model_fingerprint=FP, block_size=16, step_timeout=5)
        await group.connect()
        first_epoch = group.epoch
        await group.run_step(1, worker_pb2.StepControl(step_id=1), [[], []])
        with pytest.raises(GroupDown, match="rank 1"):
            await group.run_step(2, worker_pb2.StepControl(step_id=2), [[], []])
        assert not group.up
        ranks[1].cfg.drop_after_steps = None
        await group.connect()
        assert group.epoch > first_epoch
        assert [h.scheduler_epoch for h in ranks[0].handshakes] == [first_epoch, group.epoch]
        await group.run_step(1, worker_pb2.StepControl(step_id=1), [[], []])
        await group.close()
        for r in ranks:
            await r.stop()

    run(body())


def test_stalled_rank_hits_the_step_deadline():
    async def body():
        ranks = await start_ranks(1)
        group = WorkerGroup([ranks[0].address], model_fingerprint=FP, block_size=16, step_timeout=0.5)
        await group.connect()
        await ranks[0].stop()  # nothing answers any more
        with pytest.raises(GroupDown):
            await group.run_step(1, worker_pb2.StepControl(step_id=1), [[]])
        await group.close()

    run(body())


def test_keepalives_are_echoed_and_a_silent_rank_is_detected():
    async def body():
        ranks = await start_ranks(1)
        group = WorkerGroup([ranks[0].address], model_fingerprint=FP, block_size=16)
        await group.connect()
        await group.keepalive(stale_after=5)
        for _ in range(100):
            if group._streams[0].last_keepalive_rtt is not None:
                break
            await asyncio.sleep(0.01)
        assert group._streams[0].last_keepalive_rtt is not None
        group._streams[0].last_heard -= 10  # as if the rank had not answered for 10 s
        with pytest.raises(GroupDown, match="silent for"):
            await group.keepalive(stale_after=5)
        await group.close()
        await ranks[0].stop()

    run(body())
