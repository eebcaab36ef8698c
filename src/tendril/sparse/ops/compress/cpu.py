"""Activation compression on the CPU: the phase planes (a torch copy), then one compiled pass per channel."""

from __future__ import annotations

import torch

from tendril.sparse.format import ActivationLayout, CompressedActivations
from tendril.sparse.ops.compress.reference import phase_planes
from tendril.sparse.ops.cpu_threads import kernel_threads, kernels


def compress(x: torch.Tensor, layout: ActivationLayout, *, threads: int = 1) -> CompressedActivations:
    planes = phase_planes(x.detach().float(), layout).contiguous()
    out = CompressedActivations.empty(layout, x.device)
    with kernel_threads(threads):
        kernels().compress_planes(
            planes.numpy(),
            layout.plane_hw[1],
            layout.capacity,
            out.values.numpy(),
            out.positions.numpy(),
            out.row_ptr.numpy(),
            out.counts.numpy(),
        )
    return out
