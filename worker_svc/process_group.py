"""The tensor-parallel process group of the worker ranks, and the per-step agreement between them.

Every rank applies the same control bytes, but payload frames and caches are per rank: a rank may refuse a step
that its peers accept (a missing payload in ``lazy`` mode). Before any rank starts the sharded forward, the ranks
therefore agree on the step with one small all-reduce of their error codes (0 = fine); if any rank refused, every
rank refuses, so no rank is left waiting in a collective for a peer that will never join.

The vote also carries the step's identity (scheduler epoch, step id). Collectives pair up by order, not by name: a
rank that received a step its peer never got (the scheduler died or gave up on the step between its writes, then
a newer stream arrived) would otherwise pair that step's collectives with the peer's next step and compute on
mixed partial sums. A vote that pairs two different steps raises ``GroupDesync`` on every rank instead, and the
ranks exit so the supervisor restarts the group.
"""

from __future__ import annotations

import datetime
import logging
import socket
import urllib.parse

import torch
import torch.distributed as dist

from worker_svc import shm_allreduce
from worker_svc.config import WorkerConfig

log = logging.getLogger(__name__)

_ID_MASK = (1 << 62) - 1  # identities travel as int64 and are negated for the minimum: keep clear of overflow


def _bound_store(config: WorkerConfig, timeout: datetime.timedelta):
    """The tcp:// rendezvous store with rank 0's server bound to ``--dist-bind-host`` alone, or None (torch's own
    store, whose server listens on every interface). torch accepts an already listening socket for its server."""
    if not config.dist_bind_host or not config.dist_init.startswith("tcp://"):
        return None
    parsed = urllib.parse.urlsplit(config.dist_init)
    if parsed.hostname is None or parsed.port is None:
        raise ValueError(f"dist_init={config.dist_init!r} (--dist-init): tcp:// needs HOST:PORT")
    listener = None
    if config.rank == 0:
        family = socket.AF_INET6 if ":" in config.dist_bind_host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((config.dist_bind_host, parsed.port))
        listener.listen(128)
    # detach(): the store's server owns the listening descriptor from here on (it lives as long as the process).
    return dist.TCPStore(
        parsed.hostname,
        parsed.port,
        config.world_size,
        config.rank == 0,
        timeout,
        master_listen_fd=listener.detach() if listener is not None else None,
    )


class GroupDesync(RuntimeError):
    """The ranks voted on different steps: their collectives no longer pair up."""


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
        store = _bound_store(config, timeout)
        if store is not None:
            dist.init_process_group(
                backend, store=store, rank=config.rank, world_size=config.world_size, timeout=timeout
            )
        else:
            dist.init_process_group(
                backend, init_method=config.dist_init, rank=config.rank, world_size=config.world_size, timeout=timeout
            )
        # Votes travel on a CPU (gloo) group even when the model's collectives use NCCL.
        self._vote_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        if backend == "gloo" and config.cpu_allreduce == "auto":
            shm_allreduce.install(config.group_timeout_seconds)
        log.info("process group formed", extra={"backend": backend, "world_size": self.world_size})

    def agree(self, error_code: int, epoch: int = 0, step_id: int = 0) -> int:
        """The largest error code of any rank for this step (0: every rank accepted it). Raises ``GroupDesync``
        when the ranks are not voting on the same (epoch, step_id)."""
        if self.world_size == 1:
            return error_code
        epoch, step_id = epoch & _ID_MASK, step_id & _ID_MASK
        # One MAX all-reduce gives the largest code and both the largest and the (negated) smallest identity.
        vote = torch.tensor([error_code, epoch, step_id, -epoch, -step_id], dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._vote_group)
        code, max_epoch, max_step, neg_min_epoch, neg_min_step = vote.tolist()
        if (max_epoch, max_step) != (-neg_min_epoch, -neg_min_step):
            raise GroupDesync(
                f"rank {self.rank} voted on epoch {epoch} step {step_id}, but the group's votes span epochs "
                f"{-neg_min_epoch}..{max_epoch} and steps {-neg_min_step}..{max_step}: a peer is running another step"
            )
        return int(code)

    def any_failed(self, flags: list[int]) -> list[int]:
        """Per position, the largest flag of any rank (one MAX all-reduce on the CPU vote group): how every rank
        learns which items of a step failed at their owner before any output is shared."""
        if self.world_size == 1 or not flags:
            return list(flags)
        vote = torch.tensor(flags, dtype=torch.int64)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=self._vote_group)
        return [int(v) for v in vote.tolist()]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """``tensor`` from rank ``src`` to every rank, in place, on the model's group (gloo on CPU, NCCL on GPU):
        an item's encoder output from its owner (sharded placement)."""
        if self.world_size > 1:
            dist.broadcast(tensor, src=src)

    def close(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
            shm_allreduce.forget()
