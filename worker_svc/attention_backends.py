"""One attention backend per rank, chosen at start from its device: the operations the runner's packed step needs.

A step packs every scheduled window (prefill chunks and decode tokens) in one sequence of batch 1 and the decoder's
attention reads and writes the KV block pool in place. What differs by device is how: a backend

1. ``plan``s the step once per forward from the windows ``(block_ids, start, end)`` (slots, context rows, masks,
   batches: whatever its kernels read, built before the first layer, reused by every layer);
2. ``write``s a layer's new keys and values at their pool slots (``slot = block_id * block_size + offset``);
3. ``attend``s a layer's queries to their keys read from the pool through the block tables.

Backends:

- ``cpu`` (``worker_svc/paged_attention.py``): decode windows batched in two matmuls per layer over gathered rows,
  prefill windows one ``scaled_dot_product_attention`` each over a pool view or gathered rows;
- ``sdpa`` (``worker_svc/varlen_attention.py``): the context rows of every window gathered once per layer, then
  flash-attn's ``flash_attn_varlen_func`` over the ragged step where that package is importable on a CUDA rank
  with a half-precision pool, else torch's ``scaled_dot_product_attention`` (decode windows in one padded call,
  prefill windows one call each). It runs on CPU tensors too, which is how the tests check it; it has not yet
  run on a GPU.

``--attention-backend auto`` takes ``cpu`` on a CPU rank and ``sdpa`` on a CUDA one. The function registered with
transformers' ``AttentionInterface`` (``attention``) receives the planned step as the ``paged_step`` keyword of the
language model's forward, which transformers hands on to every layer unchanged, and calls its backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from worker_svc import paged_attention, varlen_attention

ATTN_IMPLEMENTATION = "mmcast_paged"
BACKENDS = ("auto", "cpu", "sdpa")


class AttentionBackend(Protocol):
    """What the runner's packed step asks of the attention, per device."""

    name: str

    def plan(self, pool: torch.Tensor, windows: Sequence[tuple[Sequence[int], int, int]], block_size: int):
        """The step's metadata from ``(block_ids, start, end)`` per window, in packing order."""

    def write(self, plan, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stores one layer's new ``key``/``value`` ([kv_heads, T, d]) at the step's slots."""

    def attend(self, plan, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """One layer's attention: ``query`` [heads, T, d] of the packed step; returns [T, heads, d]."""


class CpuBackend:
    """The CPU kernels of ``worker_svc/paged_attention.py`` (decode batches of two matmuls; prefill one SDPA each)."""

    name = "cpu"

    def plan(self, pool, windows, block_size) -> paged_attention.PagedStep:
        return paged_attention.plan_step(pool, windows, block_size)

    def write(self, plan, layer, key, value) -> None:
        paged_attention.write_kv(plan, layer, key, value)

    def attend(self, plan, layer, query, scaling) -> torch.Tensor:
        return paged_attention.attend(plan, layer, query, scaling)


class BoundStep(NamedTuple):
    """A planned step with the backend that planned it: what travels as ``paged_step`` to every layer."""

    backend: AttentionBackend
    plan: object


def select(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> AttentionBackend:
    """The backend ``--attention-backend name`` gives a rank on ``device`` (``auto``: cpu on CPU, sdpa on CUDA)."""
    name = name.lower()
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: choose from {', '.join(BACKENDS)} (--attention-backend)")
    device = torch.device(device)
    if name == "auto":
        name = "sdpa" if device.type == "cuda" else "cpu"
    if name == "cpu":
        return CpuBackend()
    return varlen_attention.SdpaBackend(varlen=varlen_attention.flash_varlen(device, dtype))


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    paged_step: BoundStep | None = None,
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
    backend, plan = paged_step
    backend.write(plan, module.layer_idx, key[0], value[0])
    return backend.attend(plan, module.layer_idx, query[0], scaling)[None], None


def register() -> str:
    """Registers ``attention`` with transformers (idempotent); returns its implementation name."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention)
    return ATTN_IMPLEMENTATION
