"""Attention over the rank's KV block pool, read and written in place: one ragged forward per step.

A step packs every scheduled window (prefill chunks and decode tokens of all requests) into one sequence of batch 1.
The language model is the library's own class; only its attention function is this module's, registered with
transformers' ``AttentionInterface`` under ``ATTN_IMPLEMENTATION`` and selected for the text config alone (the vision
tower keeps ``sdpa``). Each decoder layer calls ``paged_attention`` with the step's new queries, keys and values
(rotary already applied); it

1. writes the new keys and values into their pool slots (``slot = block_id * block_size + offset``), and
2. attends each request's queries to its keys read from the pool through its block table with one
   ``scaled_dot_product_attention``: a request whose blocks are one run of consecutive ids attends over a view of
   the pool (no copy); one whose table is fragmented (a cached prefix and new blocks, decodes of interleaved
   requests taking every other block) has its context rows gathered by one ``index_select`` per layer for keys and
   one for values. The copy is bounded by one request's context and nothing is written back; it replaces a matmul
   per run, which on CPU cost 5-20x a contiguous decode at 64 runs (``benchmarks/paged_attention.py``).
   Queries of a window attend causally to their own window (bottom-right aligned after the computed prefix).

What a step needs travels as the ``paged_step`` keyword of the language model's forward, which transformers hands on
to the attention function of every layer unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ATTN_IMPLEMENTATION = "mmcast_paged"


@dataclasses.dataclass(frozen=True)
class Span:
    """One request's share of the packed step."""

    start: int  # first packed token of the window
    end: int  # one past its last; end - start new tokens, computed after ``context - (end - start)`` older ones
    context: int  # tokens the window's last query attends to (computed prefix + the window)
    runs: tuple[tuple[int, int], ...]  # (first pool row, rows) per run of consecutive blocks; rows sum to context
    rows: torch.Tensor | None = None  # (context,) int64 pool rows in order, where there are several runs


@dataclasses.dataclass(frozen=True)
class PagedStep:
    """The per-step metadata every layer reads; built once per forward by ``plan_step``."""

    pool: torch.Tensor  # the KVPool's data: [layers, 2, kv_heads, num_blocks, block_size, head_dim]
    slots: torch.Tensor  # (tokens,) int64: the pool row (block_id * block_size + offset) of each packed token
    spans: tuple[Span, ...]  # in packing order; spans cover [0, tokens) without gaps


def block_runs(block_ids: Sequence[int], num_tokens: int, block_size: int) -> tuple[tuple[int, int], ...]:
    """The first ``num_tokens`` pool rows of a block table as runs of consecutive rows: (first row, rows)."""
    runs: list[list[int]] = []
    left = num_tokens
    for block in block_ids[: -(-num_tokens // block_size)]:
        rows = min(block_size, left)
        left -= rows
        row = block * block_size
        if runs and runs[-1][0] + runs[-1][1] == row:
            runs[-1][1] += rows
        else:
            runs.append([row, rows])
    return tuple((first, rows) for first, rows in runs)


def plan_step(pool: torch.Tensor, windows: Sequence[tuple[Sequence[int], int, int]], block_size: int) -> PagedStep:
    """The step's slots and spans from ``(block_ids, start, end)`` per window, in packing order: tokens
    ``[start, end)`` of a request whose table ``block_ids`` covers at least ``end`` tokens."""
    slots: list[torch.Tensor] = []
    spans: list[Span] = []
    packed = 0
    for block_ids, start, end in windows:
        positions = torch.arange(start, end)
        table = torch.as_tensor(list(block_ids[start // block_size : -(-end // block_size)]), dtype=torch.long)
        slots.append(table[positions // block_size - start // block_size] * block_size + positions % block_size)
        runs = block_runs(block_ids, end, block_size)
        rows = None
        if len(runs) > 1:
            table = torch.as_tensor(list(block_ids[: -(-end // block_size)]), dtype=torch.long)
            rows = (table[:, None] * block_size + torch.arange(block_size)).flatten()[:end].to(pool.device)
        spans.append(Span(packed, packed + end - start, end, runs, rows))
        packed += end - start
    device = pool.device
    return PagedStep(pool, torch.cat(slots).to(device) if slots else torch.empty(0, dtype=torch.long), tuple(spans))


def _allowed(rows: torch.Tensor, context: int, window: int, device) -> torch.Tensor:
    """(len(rows), context) bool: query ``i`` of a ``window``-token window ending at ``context`` sees keys up to
    ``context - window + i``."""
    limit = (context - window) + rows
    return torch.arange(context, device=device)[None, :] <= limit[:, None]


def _attend(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, span: Span, scaling: float) -> torch.Tensor:
    """Attention of one window's queries ``q`` ([heads, n, d]) over its pool rows; returns [heads, n, d]."""
    n = q.shape[1]
    if span.rows is None:
        ((first, rows),) = span.runs
        keys, values = k_layer[:, first : first + rows], v_layer[:, first : first + rows]
    else:
        keys, values = k_layer.index_select(1, span.rows), v_layer.index_select(1, span.rows)
    mask = None if n == 1 else _allowed(torch.arange(n, device=q.device), span.context, n, q.device)
    return F.scaled_dot_product_attention(
        q[None], keys[None], values[None], attn_mask=mask, scale=scaling, enable_gqa=q.shape[0] > k_layer.shape[0]
    )[0]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_step: PagedStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query [1, heads, T, d], key/value [1, kv_heads, T, d] of the
    packed step; returns ([1, T, heads, d], None). Without ``paged_step`` (a plain call of the model, e.g. by a
    test's reference run) it is the library's ``sdpa``."""
    if paged_step is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"the paged step packs every window in one row; got a batch of {query.shape[0]}")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    layer = paged_step.pool[module.layer_idx]
    kv_heads, _, _, dim = layer.shape[1:]
    k_layer = layer[0].view(kv_heads, -1, dim)  # [kv_heads, num_blocks * block_size, d]: rows are pool slots
    v_layer = layer[1].view(kv_heads, -1, dim)
    k_layer.index_copy_(1, paged_step.slots, key[0].to(k_layer.dtype))
    v_layer.index_copy_(1, paged_step.slots, value[0].to(v_layer.dtype))
    out = query.new_empty(query.shape[1:])  # [heads, T, d]
    for span in paged_step.spans:
        out[:, span.start : span.end] = _attend(query[0, :, span.start : span.end], k_layer, v_layer, span, scaling)
    return out.transpose(0, 1)[None], None


def register() -> str:
    """Registers ``paged_attention`` with transformers (idempotent); returns its implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    return ATTN_IMPLEMENTATION
