"""The shared-memory all-reduce of co-located CPU ranks (worker_svc/shm_allreduce.py), between real processes of a
real gloo group: the same results as gloo on every rank, gloo kept for what does not fit and for a group whose
ranks cannot all open the segment, nothing left under /dev/shm, and a lost peer reported at once, not after the
group timeout."""

from __future__ import annotations

import glob
import multiprocessing
import os
import socket
import time
import traceback

import pytest
import torch

from worker_svc import shm_allreduce

pytestmark = pytest.mark.skipif(shm_allreduce.supported() is not None, reason=str(shm_allreduce.supported()))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, size, port, scenario, results):
    try:
        import torch.distributed as dist

        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        torch.set_num_threads(1)
        if scenario == "refused" and rank == 1:
            real_open = os.open
            os.open = lambda path, *a, **k: (_ for _ in ()).throw(PermissionError(13, "denied", path)) \
                if str(path).startswith("/dev/shm/mmcast") else real_open(path, *a, **k)  # fmt: skip
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        shm_allreduce.install(timeout_seconds=30.0)
        out = {}
        if scenario == "peer_exits":
            if rank == 1:
                dist.all_reduce(torch.ones(3))  # the segment is opened on the group's first all-reduce
                os._exit(0)
            dist.all_reduce(torch.ones(3))
            started = time.monotonic()
            try:
                dist.all_reduce(torch.ones(3))
                out["error"] = None
            except RuntimeError as exc:
                out["error"] = str(exc)
            out["waited"] = time.monotonic() - started
            results.put((rank, out))
            results.close()
            results.join_thread()  # flushed before the hard exit (gloo would hang a normal one on its lost peer)
            os._exit(0)
        gen = torch.Generator().manual_seed(100 + rank)
        for name, tensor, op in [
            ("f32_sum", torch.randn(7, 5, generator=gen), dist.ReduceOp.SUM),
            ("bf16_sum", torch.randn(33, generator=gen).to(torch.bfloat16), dist.ReduceOp.SUM),
            ("i64_max", torch.randint(-50, 50, (9,), generator=gen), dist.ReduceOp.MAX),
            ("i64_min", torch.randint(-50, 50, (9,), generator=gen), dist.ReduceOp.MIN),
            ("large", torch.randn(shm_allreduce.SLOT_BYTES // 4 + 1, generator=gen), dist.ReduceOp.SUM),
            ("product", torch.randn(4, generator=gen), dist.ReduceOp.PRODUCT),
        ]:
            original = tensor.clone()
            for _ in range(3):  # both alternating buffers, and back
                work = tensor.clone()
                dist.all_reduce(work, op=op)
            out[name] = (original.tolist(), work.tolist(), str(tensor.dtype))  # plain data across the queue
        out["calls"] = dict(shm_allreduce.calls)
        out["left"] = glob.glob("/dev/shm/mmcast-allreduce-*")
        dist.destroy_process_group()
        results.put((rank, out))
    except BaseException:
        results.put((rank, {"traceback": traceback.format_exc()}))


def _run(scenario, size=2, timeout=120):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank_main, args=(r, size, port, scenario, results)) for r in range(size)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + timeout
    want = 1 if scenario == "peer_exits" else size
    while len(got) < want and time.monotonic() < deadline:
        try:
            rank, out = results.get(timeout=1)
        except Exception:
            continue
        assert "traceback" not in out, out["traceback"]
        got[rank] = out
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    assert len(got) == want, f"only ranks {sorted(got)} answered"
    return got


_EXPECT = {
    "f32_sum": torch.add,
    "bf16_sum": torch.add,
    "i64_max": torch.maximum,
    "i64_min": torch.minimum,
    "large": torch.add,
    "product": torch.mul,
}


@pytest.mark.parametrize("scenario", ["shared", "refused"])
def test_every_rank_gets_the_same_result_as_gloo(scenario):
    got = _run(scenario)
    for name, combine in _EXPECT.items():
        (a, ra, dtype), (b, rb, _) = got[0][name], got[1][name]
        dtype = getattr(torch, dtype.removeprefix("torch."))
        a, ra, b, rb = (torch.tensor(x, dtype=dtype) for x in (a, ra, b, rb))
        assert torch.equal(ra, rb), f"{name}: the ranks disagree"
        torch.testing.assert_close(ra, combine(a, b), rtol=0, atol=0) if ra.dtype != torch.bfloat16 else \
            torch.testing.assert_close(ra, (a.float() + b.float()).to(torch.bfloat16))  # fmt: skip
    calls = got[0]["calls"]
    if scenario == "shared":  # 4 fitting cases x 3 through the segment; the oversized one and PRODUCT on gloo
        assert calls == {"shared_memory": 12, "gloo": 6}
    else:  # rank 1 could not open the segment: the whole group stays on gloo, and says so consistently
        assert calls == {"shared_memory": 0, "gloo": 18} and got[1]["calls"] == calls
    assert got[0]["left"] == [] and got[1]["left"] == []  # the segment's name is gone once both have it open


def test_a_peer_that_exits_is_reported_at_once_not_after_the_timeout():
    out = _run("peer_exits")[0]
    assert out["error"] is not None and "rank 1" in out["error"] and "has exited" in out["error"]
    assert out["waited"] < 10  # the group timeout is 30 s
