"""The KV block pool of one rank, and the live per-request caches built from it.

Layout ``[layers, 2 (key, value), kv_heads_local, num_blocks, block_size, head_dim]``: a request's prefix is one
``index_select`` over dim 3 and a view, for every layer at once. A live cache is a transformers ``DynamicCache``
whose layers hold views of that gather (no further copy); later steps append to it. The pool is written only
when a block of a request becomes complete, at the block id the scheduler assigned.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache


class KVPool:
    """Fixed-size block storage. Block ids are the scheduler's; the pool never allocates or frees."""

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
        self.kv_heads = kv_heads  # local to this rank under tensor parallelism
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros((num_layers, 2, kv_heads, num_blocks, block_size, head_dim), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(block_ids), dtype=torch.long, device=self.data.device)

    def gather(self, block_ids: Sequence[int], num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` KV rows of ``block_ids`` as ``[layers, 2, heads, num_tokens, head_dim]``."""
        if num_tokens == 0:
            shape = (self.num_layers, 2, self.kv_heads, 0, self.head_dim)
            return self.data.new_empty(shape)
        blocks = self.data.index_select(3, self._ids(block_ids))
        merged = blocks.view(self.num_layers, 2, self.kv_heads, len(block_ids) * self.block_size, self.head_dim)
        return merged[:, :, :, :num_tokens]

    def write(self, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Stores ``kv`` (``[layers, 2, heads, len(block_ids) * block_size, head_dim]``) into ``block_ids``."""
        if not block_ids:
            return
        blocks = kv.reshape(self.num_layers, 2, self.kv_heads, len(block_ids), self.block_size, self.head_dim)
        self.data.index_copy_(3, self._ids(block_ids), blocks.to(self.data.dtype))


def cache_from_prefix(prefix: torch.Tensor, config) -> DynamicCache:
    """A live cache holding ``prefix`` (``[layers, 2, heads, len, head_dim]``), batch size 1, without a copy."""
    cache = DynamicCache(config=config)
    if prefix.shape[3] == 0:
        return cache
    for index, layer in enumerate(cache.layers):
        layer.lazy_initialization(prefix[index, 0][None], prefix[index, 1][None])
        layer.keys = prefix[index, 0][None]
        layer.values = prefix[index, 1][None]
    return cache


def cache_rows(cache: DynamicCache, start: int, end: int) -> torch.Tensor:
    """Rows ``[start, end)`` of a batch-1 live cache as ``[layers, 2, heads, end - start, head_dim]``."""
    keys = torch.stack([layer.keys[0, :, start:end] for layer in cache.layers])
    values = torch.stack([layer.values[0, :, start:end] for layer in cache.layers])
    return torch.stack([keys, values], dim=1)


def cache_length(cache: DynamicCache) -> int:
    return cache.get_seq_length()


def padded_batch_cache(caches: Sequence[DynamicCache], config) -> tuple[DynamicCache, torch.Tensor]:
    """One batch cache of the given batch-1 caches, left-padded to the longest, and its 2-D padding mask
    (``[batch, max_len]``, 1 = real row). The caller appends one column for the new tokens."""
    lengths = [cache_length(c) for c in caches]
    longest = max(lengths)
    batch = DynamicCache(config=config)
    reference = next(c for c in caches if cache_length(c) > 0) if longest else None
    mask = torch.zeros((len(caches), longest), dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, longest - length :] = 1
    if reference is None:
        return batch, mask
    for index, layer in enumerate(batch.layers):
        ref = reference.layers[index].keys
        shape = (len(caches), ref.shape[1], longest, ref.shape[3])
        keys, values = ref.new_zeros(shape), ref.new_zeros(shape)
        for row, (cache, length) in enumerate(zip(caches, lengths, strict=True)):
            if length:
                keys[row, :, longest - length :] = cache.layers[index].keys[0]
                values[row, :, longest - length :] = cache.layers[index].values[0]
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return batch, mask.to(reference.layers[0].keys.device)


def append_batch_rows(caches: Sequence[DynamicCache], batch: DynamicCache, count: int) -> None:
    """Appends the last ``count`` rows of each batch row to the matching batch-1 cache."""
    for index, layer in enumerate(batch.layers):
        new_keys = layer.keys[:, :, -count:]
        new_values = layer.values[:, :, -count:]
        for row, cache in enumerate(caches):
            cache.layers[index].update(new_keys[row : row + 1], new_values[row : row + 1])
