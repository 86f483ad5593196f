"""How many blocks a rank's KV pool holds (worker_svc/kv_pool.py), decided once, after the model has loaded.

``--kv-blocks`` fixes the count. Without it (0, the default) the pool takes ``--kv-cache-memory-fraction`` of the
memory still available once the weights are in place — vLLM's ``gpu_memory_utilization`` on CUDA, its
``VLLM_CPU_KVCACHE_SPACE`` on CPU — and at most ``--kv-cache-max-bytes``:

- CUDA: the device's free memory (``torch.cuda.mem_get_info``); one rank per device.
- CPU: the kernel's ``MemAvailable``, or what the container's cgroup still allows where that is less (a pod's
  memory limit is far below the node's), shared by the ``--local-ranks`` ranks of the group on the machine: each
  takes its share, so the ranks together stay within the fraction.

The cap keeps a machine shared with other work (and the test suite, which starts many ranks) from giving one pool
gigabytes by default; a machine of its own raises it, or sets 0 for none. The count reaches the scheduler in the
handshake (``HandshakeAck.kv_blocks``), whose prefix cache has exactly that many blocks.
"""

from __future__ import annotations

import dataclasses
import pathlib

MAX_BLOCKS = 1 << 24  # the --kv-blocks setting's own bound: block ids are uint32 on the wire, tables stay small


class PoolSizeError(ValueError):
    """Not even one block fits the memory the settings allow; the message names them (a start-up failure)."""


def block_bytes(*, num_layers: int, kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one block of the pool: keys and values of ``block_size`` tokens, every layer, this rank's heads."""
    return num_layers * 2 * kv_heads * block_size * head_dim * dtype_bytes


@dataclasses.dataclass(frozen=True)
class PoolSize:
    blocks: int
    block_bytes: int
    reason: str  # why this many, for the start-up log line

    @property
    def nbytes(self) -> int:
        return self.blocks * self.block_bytes


def size_pool(
    *,
    block_bytes: int,
    kv_blocks: int,
    available_bytes: int,
    fraction: float,
    max_bytes: int,
    sharers: int = 1,
    source: str = "available memory",
) -> PoolSize:
    """The pool's size: ``kv_blocks`` when > 0, else ``fraction`` of ``available_bytes / sharers`` up to ``max_bytes``
    (0: no cap), in whole blocks. Raises ValueError naming the settings when not even one block fits."""
    if block_bytes < 1:
        raise ValueError(f"block_bytes={block_bytes} must be >= 1")
    if kv_blocks > 0:
        return PoolSize(kv_blocks, block_bytes, "--kv-blocks")
    share = int(max(0, available_bytes) * fraction) // max(1, sharers)
    budget = min(share, max_bytes) if max_bytes > 0 else share
    blocks = min(budget // block_bytes, MAX_BLOCKS)
    if blocks < 1:
        raise PoolSizeError(
            f"the KV pool cannot hold one block: --kv-cache-memory-fraction={fraction:g} of {available_bytes} bytes "
            f"of {source}{f' over {sharers} local ranks' if sharers > 1 else ''}"
            f"{f' (at most --kv-cache-max-bytes={max_bytes})' if 0 < max_bytes < share else ''} is {budget} bytes, "
            f"and one block takes {block_bytes}; raise --kv-cache-memory-fraction or --kv-cache-max-bytes, free "
            "memory, or set --kv-blocks"
        )
    why = f"{fraction:g} of {available_bytes} bytes of {source}"
    if sharers > 1:
        why += f" over {sharers} local ranks"
    if 0 < max_bytes < share:
        why += f", capped by --kv-cache-max-bytes={max_bytes}"
    return PoolSize(blocks, block_bytes, why)


def _meminfo_available(path: str = "/proc/meminfo") -> int | None:
    try:
        for line in pathlib.Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_available(root: str = "/sys/fs/cgroup") -> int | None:
    """cgroup v2's limit less its usage; None without a limit (``max``) or without cgroup v2."""
    try:
        limit = pathlib.Path(root, "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int(pathlib.Path(root, "memory.current").read_text().strip()))
    except (OSError, ValueError):
        return None


def available_memory(device) -> tuple[int, str]:
    """(bytes available for the pool on ``device`` now, where the number comes from)."""
    if device.type == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info(device)
        return int(free), f"free memory of {device} (torch.cuda.mem_get_info)"
    found = [
        (v, what)
        for v, what in ((_meminfo_available(), "MemAvailable"), (_cgroup_available(), "cgroup"))
        if v is not None
    ]
    if not found:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free physical pages (sysconf)"
    value, what = min(found)
    return value, f"the machine's memory ({what})"
