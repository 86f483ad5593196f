"""The ``sdpa`` attention backend (``worker_svc/attention_backends.py``): the GPU's path over the same block pool.

Two kernels, one plan:

- **flash-attn varlen** where ``flash_attn`` is importable, the rank is on CUDA and the pool is float16/bfloat16:
  per layer one ``index_select`` gathers every window's context rows in packing order (keys, then values), and one
  ``flash_attn_varlen_func`` call attends the whole ragged step (``cu_seqlens_q``/``cu_seqlens_k`` from the
  windows; its causal mask is aligned bottom-right, so a window after a computed prefix sees that prefix);
- **torch SDPA** otherwise: decode windows in padded batches (the CPU backend's grouping and key mask) attended by
  one ``scaled_dot_product_attention`` per batch, prefill windows one call each over a pool view or gathered rows
  with their causal mask; on CUDA torch picks its fused kernels for these calls.

Both run on CPU tensors (the tests compare them with the CPU backend on random pools, the varlen one through a
reference function of flash-attn's signature), but neither has yet run on a GPU.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from worker_svc import paged_attention

# flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=, causal=)
VarlenFn = Callable[..., torch.Tensor]


def flash_varlen(device: torch.device, dtype: torch.dtype) -> VarlenFn | None:
    """flash-attn's varlen function where it can serve this rank (CUDA, half precision, package importable)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@dataclasses.dataclass(frozen=True)
class VarlenStep:
    """A step planned for the ``sdpa`` backend."""

    paged: paged_attention.PagedStep  # pool, slots, and the SDPA path's decode batches and single windows
    rows: torch.Tensor | None = None  # varlen: (sum of contexts,) int64 pool rows of every window, packing order
    cu_q: torch.Tensor | None = None  # varlen: (windows + 1,) int32 offsets of each window's queries
    cu_k: torch.Tensor | None = None  # varlen: (windows + 1,) int32 offsets of each window's context rows
    max_q: int = 0  # varlen: the longest window
    max_k: int = 0  # varlen: the longest context


def _varlen_plan(paged, windows, block_size: int, device) -> VarlenStep:
    rows: list[torch.Tensor] = []
    cu_q, cu_k = [0], [0]
    for block_ids, start, end in windows:
        table = torch.as_tensor(list(block_ids[: -(-end // block_size)]), dtype=torch.long)
        rows.append((table[:, None] * block_size + torch.arange(block_size)).flatten()[:end])
        cu_q.append(cu_q[-1] + end - start)
        cu_k.append(cu_k[-1] + end)
    return VarlenStep(
        paged,
        torch.cat(rows).to(device),
        torch.tensor(cu_q, dtype=torch.int32, device=device),
        torch.tensor(cu_k, dtype=torch.int32, device=device),
        max(end - start for _, start, end in windows),
        max(end for _, _, end in windows),
    )


class SdpaBackend:
    """Attention by torch's SDPA, or by ``varlen`` (flash-attn's function) over the whole step where given."""

    name = "sdpa"

    def __init__(self, varlen: VarlenFn | None = None) -> None:
        self.varlen = varlen

    def plan(self, pool: torch.Tensor, windows: Sequence[tuple[Sequence[int], int, int]], block_size: int):
        paged = paged_attention.plan_step(pool, windows, block_size)
        if self.varlen is None:
            return VarlenStep(paged)
        return _varlen_plan(paged, windows, block_size, pool.device)

    def write(self, plan: VarlenStep, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        paged_attention.write_kv(plan.paged, layer, key, value)

    def attend(self, plan: VarlenStep, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        k_layer, v_layer = paged_attention.layer_rows(plan.paged.pool, layer)
        if self.varlen is not None:
            # [rows, kv_heads, d]: flash-attn's layout; its GQA maps each query head to its KV head itself
            keys = k_layer.index_select(1, plan.rows).transpose(0, 1).contiguous()
            values = v_layer.index_select(1, plan.rows).transpose(0, 1).contiguous()
            return self.varlen(
                query.transpose(0, 1).contiguous(), keys, values, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k,
                softmax_scale=scaling, causal=True,
            )  # fmt: skip
        out = query.new_empty(query.shape[1], query.shape[0], query.shape[2])  # [T, heads, d]
        for batch in plan.paged.batches:
            out.index_copy_(0, batch.tokens, _attend_batch(query, k_layer, v_layer, batch, scaling))
        for span in plan.paged.singles:
            out[span.start : span.end] = paged_attention.attend_window(
                query[:, span.start : span.end], k_layer, v_layer, span, scaling
            ).transpose(0, 1)
        return out


def _attend_batch(query, k_layer, v_layer, batch: paged_attention.DecodeBatch, scaling: float) -> torch.Tensor:
    """A decode batch in one SDPA call: queries [n, heads, 1, d] over their gathered rows [n, kv_heads, width, d];
    returns [n, heads, d]."""
    kv_heads, _, dim = k_layer.shape
    n = batch.tokens.numel()
    q = query.index_select(1, batch.tokens).transpose(0, 1)[:, :, None]
    keys = paged_attention.gather_blocks(k_layer, batch.blocks, batch.block_size, batch.index)
    values = paged_attention.gather_blocks(v_layer, batch.blocks, batch.block_size, batch.index)
    keys, values = (t.view(kv_heads, n, batch.width, dim).transpose(0, 1) for t in (keys, values))
    mask = batch.window_bias[:, None] if batch.bias is not None else None  # (n, 1, 1, width)
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scaling, enable_gqa=query.shape[0] > kv_heads
    )
    return out[:, :, 0]
