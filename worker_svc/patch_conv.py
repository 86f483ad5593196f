"""A vision tower's patch embedding as one matrix product.

Qwen-VL towers embed patches with a ``Conv3d`` whose kernel equals its stride, applied to a batch of single patches
(``[patches, channels, temporal, patch, patch]``): each output is one dot product of a flattened patch with a
flattened filter, so the convolution is a ``[patches, C*T*P*P] @ [C*T*P*P, embed]`` product. The CPU's convolution
kernel for that shape runs far below the CPU's matmul rate (one 448x448 image on the head64 checkpoint, one
thread: 25 ms in ``mkldnn_convolution``, ~3 ms as a product; vLLM serves the same layer as a linear). Only the
module's ``forward`` is swapped, and only for inputs whose spatial extent is exactly one kernel; any other input
(a CLIP tower's whole image) takes the library's convolution unchanged.
"""

from __future__ import annotations

import torch


def _single_patch_forward(conv: torch.nn.Conv2d | torch.nn.Conv3d):
    original = conv.forward
    kernel = tuple(conv.kernel_size)
    weight = conv.weight.detach().reshape(conv.out_channels, -1).t()  # a view: the weights are not copied
    bias = None if conv.bias is None else conv.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if tuple(x.shape[2:]) != kernel or x.dtype != weight.dtype:
            return original(x)
        flat = x.reshape(x.shape[0], -1)
        out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
        return out.view(x.shape[0], conv.out_channels, *([1] * len(kernel)))

    return forward


def swap_patch_convolutions(module: torch.nn.Module) -> int:
    """Gives every convolution of ``module`` whose kernel equals its stride (no padding, dilation or groups) the
    single-patch product as its ``forward``; returns how many."""
    swapped = 0
    for m in module.modules():
        if not isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)) or "forward" in vars(m):
            continue
        if (
            tuple(m.kernel_size) != tuple(m.stride)
            or any(tuple(m.padding) if not isinstance(m.padding, str) else (1,))
            or any(d != 1 for d in m.dilation)
            or m.groups != 1
        ):
            continue
        m.forward = _single_patch_forward(m)
        swapped += 1
    return swapped
