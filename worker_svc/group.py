"""The tensor-parallel process group of the worker ranks, and the per-step agreement between them.

Every rank applies the same control bytes, but payload frames and caches are per rank: a rank may refuse a step
that its peers accept (a missing payload in ``lazy`` mode). Before any rank starts the sharded forward, the ranks
therefore agree on the step with one small all-reduce of their error codes (0 = fine); if any rank refused, every
rank refuses, so no rank is left waiting in a collective for a peer that will never join.
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from worker_svc.config import WorkerConfig

log = logging.getLogger(__name__)


class Group:
    """The process group of a rank (a trivial one when ``world_size == 1``)."""

    def __init__(self, config: WorkerConfig, device: torch.device) -> None:
        self.world_size = config.world_size
        self.rank = config.rank
        self._vote_group = None
        if self.world_size == 1:
            return
        timeout = datetime.timedelta(seconds=config.group_timeout_seconds)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=config.dist_init, rank=config.rank, world_size=config.world_size, timeout=timeout
        )
        # Votes travel on a CPU (gloo) group even when the model's collectives use NCCL.
        self._vote_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        log.info("process group formed", extra={"backend": backend, "world_size": self.world_size})

    def agree(self, error_code: int) -> int:
        """The largest error code of any rank for this step (0: every rank accepted it)."""
        if self.world_size == 1:
            return error_code
        flag = torch.tensor([error_code], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._vote_group)
        return int(flag.item())

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
