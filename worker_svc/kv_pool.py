"""The KV block pool of one rank: where every request's keys and values live, read and written in place.

Layout ``[layers, 2 (key, value), kv_heads_local, num_blocks, block_size, head_dim]``. Per layer and per key/value,
``[kv_heads, num_blocks * block_size, head_dim]`` is a view in which row ``block_id * block_size + offset`` holds
token ``offset`` of block ``block_id`` (a *slot*), and a run of consecutive block ids is one contiguous range of
rows: the attention of ``worker_svc/paged_attention.py`` writes each new token's KV at its slot and reads a
request's prefix through views of those ranges. Block ids are the scheduler's; the pool never allocates or frees.
"""

from __future__ import annotations

import torch


class KVPool:
    """Fixed-size block storage, shared by every request of the rank."""

    def __init__(
        self,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.kv_heads = kv_heads  # local to this rank under tensor parallelism (replicated heads included)
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros((num_layers, 2, kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def rows(self, layer: int, kind: int) -> torch.Tensor:
        """Keys (``kind`` 0) or values (1) of ``layer`` as ``[kv_heads, num_blocks * block_size, head_dim]`` (a view)."""
        return self.data[layer, kind].view(self.kv_heads, self.num_blocks * self.block_size, self.head_dim)

    def move(self, block_ids, src: int, dst: int, count: int) -> None:
        """Copies the KV of tokens ``[src, src + count)`` of a block table to tokens ``[dst, dst + count)`` of the
        same table, every layer and head (a live session's compaction; the rows are read before any is written,
        so the ranges may overlap)."""
        bs = self.block_size
        table = torch.as_tensor(list(block_ids), dtype=torch.long)

        def rows(first: int) -> torch.Tensor:
            t = torch.arange(first, first + count)
            return table[t // bs] * bs + t % bs

        view = self.data.view(self.num_layers, 2, self.kv_heads, self.num_blocks * bs, self.head_dim)
        view[:, :, :, rows(dst)] = view[:, :, :, rows(src)]
