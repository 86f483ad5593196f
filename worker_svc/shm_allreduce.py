"""All-reduce through shared memory for the CPU ranks of a group that share one machine.

On CPU the ranks' collectives go through gloo over loopback TCP, which costs 1-2 ms per all-reduce of a few bytes on
the 2-core reference VM (a socket round trip between two processes there: ~15 µs). A decode step of a TP=2 group
makes at least five (two per decoder layer and the embedding's, plus the step's vote), so gloo alone made a TP=2
decode step ~3x a TP=1 one. Here each rank copies its tensor into its slot of a segment under ``/dev/shm``,
publishes a sequence number, waits until every rank has published the same one, and sums the slots in rank order
(so every rank ends with the same bits). Two alternating buffers let a rank start the next all-reduce while a slower
peer is still reading the last one: no second barrier.

How it is wired: transformers' tensor parallelism (DTensor) and the step votes both end in the dispatcher op
``c10d::allreduce_``; ``install`` registers this module's CPU kernel for it. The kernel takes the call when the group
has a segment and the tensor fits a slot (``SLOT_BYTES``: a decode batch's hidden states; long prefill chunks, whose
all-reduce is small beside their compute, stay on gloo) with a dtype and op it handles; otherwise it hands the call
to the group's own gloo backend unchanged. A group gets its segment on its first all-reduce: rank 0 creates it
(mode 0600, a random name published through the group's rendezvous store), every rank opens it and says whether
it could, and the name is unlinked once all have it open (nothing is left under ``/dev/shm``, even after SIGKILL).
If any rank cannot open it (ranks in other containers or on other machines), the whole group stays on gloo.

Failure: a rank waiting for a peer checks every 50 ms whether the peer's process still lives (when they share a
PID namespace) and gives up after the group timeout (``--group-timeout-seconds``), raising ``RuntimeError`` like a
gloo timeout, so the rank exits and the group restarts. Only x86-64 is enabled: its stores are seen in program order
(the data before the sequence number); elsewhere the ranks keep gloo.
"""

from __future__ import annotations

import datetime
import logging
import mmap
import os
import platform
import secrets
import time

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future

log = logging.getLogger(__name__)

SLOT_BYTES = 1 << 20  # per rank and buffer: 256k float32 elements (a 64-token decode batch at hidden 3584)
HEADER_BYTES = 4096  # sequence numbers and pids, one int64 each per rank
_OPS = {
    int(dist.ReduceOp.RedOpType.SUM): lambda x: x.sum(0),
    int(dist.ReduceOp.RedOpType.MAX): lambda x: x.amax(0),
    int(dist.ReduceOp.RedOpType.MIN): lambda x: x.amin(0),
}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32)
_SPINS_BEFORE_YIELD = 64
_LIVENESS_PERIOD_S = 0.05

_state: dict = {"timeout": 60.0}
calls = {"shared_memory": 0, "gloo": 0}  # all-reduces this process made each way (tests and the logs read them)
_segments: dict[str, Segment | None] = {}  # group name -> its segment, or None: the group stays on gloo


def supported() -> str | None:
    """Why this machine cannot use it, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} stores are not ordered as x86-64's"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm"
    return None


class Segment:
    """One group's shared slots: ``data[buffer, rank]`` of ``SLOT_BYTES`` each, and per rank a sequence number."""

    def __init__(self, fd: int, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self._map = mmap.mmap(fd, HEADER_BYTES + 2 * size * SLOT_BYTES)
        os.close(fd)
        self.seq_of = np.ndarray((size,), dtype=np.int64, buffer=self._map, offset=0)
        self.pid_of = np.ndarray((size,), dtype=np.int64, buffer=self._map, offset=8 * size)
        self.pid_ns = os.stat("/proc/self/ns/pid").st_ino if os.path.exists("/proc/self/ns/pid") else 0
        self.ns_of = np.ndarray((size,), dtype=np.int64, buffer=self._map, offset=16 * size)
        self.data = torch.frombuffer(self._map, dtype=torch.uint8, offset=HEADER_BYTES).view(2, size, SLOT_BYTES)
        self.seq = 0
        self.pid_of[rank] = os.getpid()
        self.ns_of[rank] = self.pid_ns

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.dtype in _DTYPES and tensor.numel() * tensor.element_size() <= SLOT_BYTES

    def all_reduce(self, tensor: torch.Tensor, reduce) -> None:
        self.seq += 1
        buffer = self.data[self.seq & 1]
        nbytes = tensor.numel() * tensor.element_size()
        slots = buffer[:, :nbytes].view(tensor.dtype).view(self.size, *tensor.shape)
        slots[self.rank].copy_(tensor)
        self.seq_of[self.rank] = self.seq
        self._wait()
        tensor.copy_(reduce(slots))

    def _wait(self) -> None:
        spins = 0
        started = checked = None
        while (self.seq_of < self.seq).any():
            spins += 1
            if spins < _SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()  # two ranks on two shared cores: give the peer the core it is waiting for
            now = time.monotonic()
            if started is None:
                started = checked = now
            elif now - checked >= _LIVENESS_PERIOD_S:
                checked = now
                self._check_peers(now - started)

    def _check_peers(self, waited: float) -> None:
        late = [r for r in range(self.size) if self.seq_of[r] < self.seq]
        for r in late:
            if self.ns_of[r] == self.pid_ns and self.pid_ns and not _alive(int(self.pid_of[r])):
                raise RuntimeError(f"shared-memory all-reduce: rank {r} (pid {int(self.pid_of[r])}) has exited")
        if waited > _state["timeout"]:
            raise RuntimeError(
                f"shared-memory all-reduce: rank(s) {late} did not arrive within the group timeout "
                f"({_state['timeout']:.0f} s, --group-timeout-seconds)"
            )


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: an exited process not yet reaped by its parent (a zombie) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return state not in ("Z", "X")


def _open(group: dist.ProcessGroup) -> Segment | None:
    """The group's segment, created by its rank 0; None when any rank could not open it."""
    store = dist.PrefixStore(f"mmcast-shm-allreduce/{group.group_name}/", dist.distributed_c10d._get_default_store())
    rank, size = group.rank(), group.size()
    path = None
    segment = None
    try:
        if rank == 0:
            path = f"/dev/shm/mmcast-allreduce-{secrets.token_hex(8)}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, HEADER_BYTES + 2 * size * SLOT_BYTES)
            store.set("path", path)
        else:
            path = store.get("path").decode()
            fd = os.open(path, os.O_RDWR)
        segment = Segment(fd, rank, size)
        store.set(f"opened/{rank}", "1")
    except OSError as exc:
        log.info("shared-memory all-reduce unavailable; the group keeps gloo", extra={"error": repr(exc)})
        store.set(f"opened/{rank}", "0")
    everyone = all(store.get(f"opened/{r}") == b"1" for r in range(size))
    if rank == 0 and path:
        os.unlink(path)  # every rank has answered: the mappings stay, the name goes
    if not everyone:
        return None
    log.info("shared-memory all-reduce on", extra={"group": group.group_name, "world_size": size})
    return segment


def _kernel(tensors, process_group, reduce_op, sparse_indices, async_op=True, timeout=-1):
    group = dist.ProcessGroup.unbox(process_group)
    op = int(reduce_op.op())
    name = group.group_name
    if name not in _segments and group.size() > 1:
        _segments[name] = _open(group)
    segment = _segments.get(name)
    if (
        segment is not None
        and sparse_indices is None
        and len(tensors) == 1
        and op in _OPS
        and tensors[0].is_contiguous()
        and segment.fits(tensors[0])
    ):
        segment.all_reduce(tensors[0], _OPS[op])
        calls["shared_memory"] += 1
        future = torch.futures.Future()
        future.set_result(tensors)
        return tensors, _create_work_from_future(future).boxed()
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.RedOpType(op))
    if timeout >= 0:
        opts.timeout = datetime.timedelta(milliseconds=timeout)
    if sparse_indices is not None:
        opts.sparseIndices = sparse_indices
    work = group._get_backend(torch.device("cpu")).allreduce(tensors, opts)
    calls["gloo"] += 1
    return tensors, work.boxed()


_library = None


def forget() -> None:
    """Drops every group's segment: a process group formed again later (same names) opens fresh ones."""
    _segments.clear()


def install(timeout_seconds: float) -> bool:
    """Routes the CPU all-reduces of this process's groups through shared memory where every rank can (idempotent).
    Returns False, and changes nothing, on a machine it does not support."""
    global _library
    why = supported()
    if why is not None:
        log.info("shared-memory all-reduce off", extra={"reason": why})
        return False
    _state["timeout"] = timeout_seconds
    if _library is None:
        import warnings

        _library = torch.library.Library("c10d", "IMPL")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            _library.impl("allreduce_", _kernel, "CPU")
    return True
