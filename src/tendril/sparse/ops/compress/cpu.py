"""Activation compression on the CPU: one compiled pass per virtual channel over the dense input."""

from __future__ import annotations

import torch

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.ops.cpu_threads import kernel_threads, kernels


def compress(x: torch.Tensor, layout: ActivationLayout, *, threads: int = 1) -> CompressedActivations:
    if tuple(x.shape) != (layout.channels, *layout.in_hw):
        raise ValueError(f"activation shape {tuple(x.shape)}: the layout expects {(layout.channels, *layout.in_hw)}")
    out = CompressedActivations.empty(layout, x.device)
    with kernel_threads(threads):
        kernels().compress_planes(
            x.detach().float().contiguous().numpy(),
            *layout.stride,
            *layout.padding,
            *layout.plane_hw,
            layout.capacity,
            out.values.numpy(),
            out.positions.numpy(),
            out.row_ptr.numpy(),
            out.counts.numpy(),
        )
    return out
