"""Runs a real SchedulerServer in-process (its asyncio loop in a background thread) against fake ranks, so
tests can drive it with ordinary synchronous gRPC clients."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from common.hashing import model_fingerprint
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import SchedulerServer
from tests.support.fake_rank import FakeRank, FakeRankConfig
from tests.support.worker_driver import RANK_TOKEN, rank_token_file


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="harness-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@contextlib.contextmanager
def scheduler_server(config: SchedulerConfig, ready_timeout: float = 60.0):
    """The real scheduler server on its own event loop, connected to real ranks (``config.workers``); yields its
    client port once the group is ready, stops it on exit."""
    loop = LoopThread()
    server = SchedulerServer(config)

    async def up() -> int:
        port = await server.start()
        assert await server.engine.wait_ready(ready_timeout), server.engine.last_down_reason
        return port

    try:
        yield loop.run(up())
    finally:
        try:
            loop.run(server.stop(drain_seconds=0))
        finally:
            loop.close()


@contextlib.contextmanager
def scheduler_client(rank_ports, model_dir, **settings):
    """The real scheduler server connected to real ranks listening on ``rank_ports`` (the shared test token, a new
    epoch), with 128 KV blocks unless ``settings`` say otherwise; yields an SDK client of it."""
    from mmcast_client import Client

    settings = {"kv_blocks": 128, "scheduler_id": "test", **settings}
    config = SchedulerConfig(
        model=str(model_dir),
        workers=[f"127.0.0.1:{p}" for p in rank_ports],
        listen="127.0.0.1:0",
        metrics_port=0,
        worker_token_file=rank_token_file(),
        **settings,
    )
    with scheduler_server(config) as port, Client(f"127.0.0.1:{port}", timeout=300) as client:
        yield client


class FakeGroupScheduler:
    """A scheduler process's insides on loopback, with ``n_ranks`` recording fake ranks that demand the shared
    token, which the scheduler sends (``--worker-token-file``)."""

    def __init__(self, model_dir, n_ranks: int = 2, rank_kw: dict | None = None, **config) -> None:
        self.model_dir = model_dir
        self.n_ranks = n_ranks
        self.rank_kw = rank_kw or {}
        self.config_kw = config
        self.lt = LoopThread()
        self.ranks: list[FakeRank] = []
        self.server: SchedulerServer | None = None
        self.target = ""
        self.plans: list = []  # every StepPlan the core produced, in order

    def start(self) -> FakeGroupScheduler:
        fp = model_fingerprint(self.model_dir)

        async def up():
            self.ranks = [
                FakeRank(
                    FakeRankConfig(rank=r, world_size=self.n_ranks, fingerprint=fp, token=RANK_TOKEN, **self.rank_kw)
                )
                for r in range(self.n_ranks)
            ]
            for r in self.ranks:
                await r.start()
            cfg = SchedulerConfig(
                model=str(self.model_dir),
                workers=[r.address for r in self.ranks],
                listen="127.0.0.1:0",
                metrics_port=0,
                worker_token_file=rank_token_file(),
                **self.config_kw,
            )
            self.server = SchedulerServer(cfg)
            self._record_plans()
            port = await self.server.start()
            assert await self.server.engine.wait_ready(20), self.server.engine.last_down_reason
            return port

        self.target = f"127.0.0.1:{self.lt.run(up())}"
        return self

    def _record_plans(self) -> None:
        group = self.server.group
        original = group.send_step

        async def recording(step_id, control, rank_payloads):
            self.plans.append((step_id, control, rank_payloads))
            return await original(step_id, control, rank_payloads)

        group.send_step = recording

    def call(self, fn, *args):
        """Run ``fn(*args)`` on the server's loop (for reading engine/core state without races)."""

        async def inner():
            return fn(*args)

        return self.lt.run(inner())

    def stop(self) -> None:
        async def down():
            if self.server is not None:
                await self.server.stop(drain_seconds=0)
            for r in self.ranks:
                await r.stop()

        try:
            self.lt.run(down())
        finally:
            self.lt.close()
