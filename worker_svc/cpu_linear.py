"""The decoder's linear layers on oneDNN-packed weights: a CPU rank's matrix products at decode batch sizes.

A decode step multiplies a few rows (one per request) by every weight matrix of the decoder and by ``lm_head``.
On CPU, PyTorch's dense ``linear`` runs these skinny products far below the machine's arithmetic rate; the same
products over a weight held in oneDNN's own layout (``Tensor.to_mkldnn``, or the few-row layout ``DECODE_ROWS``
picks) run 1.4-2.5x faster at 1-64 rows and about even at prefill sizes, thousands of rows
(``benchmarks/rank/rank_engine.py --cpu-linear dense`` measures the difference end to end; docs/PERFORMANCE.md,
"The rank's forward", has the figures). The results agree with the dense
product to float32 rounding (relative ~1e-6; the summation order differs).

``pack`` swaps each ``nn.Linear``'s ``forward`` for one that multiplies by the packed weight; the module objects,
their names and the library's model classes stay as they are. A dense weight no other module shares is released
(its memory is the packed copy's); a weight shared with the token embedding (tied ``lm_head``) is kept, so that
layer costs one more copy of the matrix (logged).

Only where it applies: a CPU rank of a one-rank group, float32, with oneDNN in the PyTorch build. A tensor-parallel
rank's weights are the library's distributed tensors with their own forward wrappers; they stay dense.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

log = logging.getLogger(__name__)


def unsupported(device: torch.device, dtype: torch.dtype, world_size: int) -> str | None:
    """Why packed weights cannot serve this rank, or None."""
    if device.type != "cpu":
        return f"device {device} (packing is for CPU ranks)"
    if dtype != torch.float32:
        return f"dtype {dtype} (packing serves float32)"
    if world_size != 1:
        return f"world size {world_size} (tensor-parallel weights stay the library's own)"
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch build has no oneDNN"
    return None


# The product over a packed weight taking and giving ordinary tensors (the op PyTorch's own CPU compiler emits for
# frozen linear layers); without it, the public ``mkldnn_linear`` on converted inputs (two more copies per call).
_POINTWISE = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
# The weight laid out for products of a few rows (the op PyTorch's CPU compiler packs frozen weights with, given the
# batch size it expects); without it, ``Tensor.to_mkldnn``'s layout.
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
# The rows the layout is chosen for: a decode step's. Any value from 2 on gives the same layout here. Twelve
# 1536x8960 weights (Qwen2-VL-2B's MLP) in turn, so each is read from memory, 16 rows, 2 threads: 3.3-3.5 ms a
# product against 3.8 with ``to_mkldnn``'s layout (16-16.7 against 14.3-14.5 GB/s of weights); one row and prefill
# sizes (256-2,048 rows) alike. The in-process decode step of 16 requests at 1k tokens on the 2B-width checkpoint
# with a 1k vocabulary: 61.5 against 63.3 ms. Sixteen float32 rows are bound by arithmetic here, not by memory: one
# thread runs them at ~8 GB/s of weights (~64 GFLOP/s), where a one-row product streams ~14.7 GB/s.
DECODE_ROWS = 16


class PackedLinear:
    """``forward`` of one linear layer over its oneDNN-packed weight; any leading shape, float32 in and out."""

    def __init__(self, module: torch.nn.Linear) -> None:
        weight = module.weight.detach()
        self.weight = _REORDER(weight, DECODE_ROWS) if _REORDER is not None else weight.to_mkldnn()
        self.bias = module.bias.detach().clone() if module.bias is not None else None
        self.out_features = module.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if _POINTWISE is not None:
            out = _POINTWISE(rows, self.weight, self.bias, "none", [], "")
        else:
            bias = self.bias.to_mkldnn() if self.bias is not None else None
            out = torch._C._nn.mkldnn_linear(rows.to_mkldnn(), self.weight, bias).to_dense()
        return out.view(*x.shape[:-1], self.out_features)


def pack(modules: Iterable[torch.nn.Linear], keep: Iterable[torch.Tensor] = ()) -> dict[str, int]:
    """Packs every given linear layer in place; a weight that is one of ``keep`` (shared elsewhere) stays dense
    beside its packed copy. Returns byte counts: ``packed`` and ``kept`` (the dense copies kept)."""
    keep_ids = {id(t) for t in keep}
    packed = kept = 0
    for module in modules:
        if type(module).forward is not torch.nn.Linear.forward or "forward" in vars(module):
            continue  # a subclass or an already wrapped forward: its own semantics
        weight = module.weight
        module.forward = PackedLinear(module)
        size = weight.numel() * weight.element_size()
        packed += size
        if id(weight) in keep_ids:
            kept += size
        else:
            module.weight = None  # the packed copy is the only one left
    return {"packed": packed, "kept": kept}


# ``--cpu-linear auto`` packs a weight only from this many elements. Below it the dense product is faster at one row
# and even at 32 (one thread, dense vs packed: 256x768 36 vs 56 us at one row, 194 vs 195 at 32; 256x1024 42 vs 51);
# from ~0.5M weights packing wins from a few rows on (512x1024 at 32 rows 477 vs 404 us, 1536x8960 at one row 3.4
# vs 2.8 ms). Every layer of Qwen2-VL-2B's decoder (its KV projections have 393k) stays packed.
AUTO_MIN_ELEMENTS = 300_000


def pack_decoder(model: torch.nn.Module, min_elements: int = 0) -> dict[str, int]:
    """Packs the language model's linear layers and ``lm_head`` of at least ``min_elements`` weights (not the vision
    tower: its products are long)."""
    language = model.model.language_model
    embed = model.get_input_embeddings()
    layers = [m for m in language.modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        layers.append(head)
    chosen = [m for m in layers if m.weight is not None and m.weight.numel() >= min_elements]
    sizes = pack(chosen, keep=[embed.weight])
    log.info(
        "decoder linear layers packed for oneDNN",
        extra={"layers": len(chosen), "dense": len(layers) - len(chosen), **sizes},
    )
    return {**sizes, "layers": len(chosen)}
