"""Activation compression on the CPU, vectorized: one prefix sum per virtual channel gives each nonzero its slot."""

from __future__ import annotations

import torch

from tendril.sparse.format import ActivationLayout, CompressedActivations
from tendril.sparse.ops.compress.reference import phase_planes


def compress(x: torch.Tensor, layout: ActivationLayout) -> CompressedActivations:
    planes = phase_planes(x, layout)
    nonzero = planes != 0
    slots = torch.cumsum(nonzero, dim=1, dtype=torch.int32) - 1
    out = CompressedActivations.empty(layout, x.device)
    out.counts.copy_(nonzero.sum(dim=1, dtype=torch.int32))
    rows = nonzero.view(layout.virtual_channels, *layout.plane_hw).sum(2, dtype=torch.int32)
    out.row_ptr[:, 0] = 0
    torch.cumsum(rows, 1, out=out.row_ptr[:, 1:])
    keep = nonzero & (slots < layout.capacity)
    channel, position = keep.nonzero(as_tuple=True)
    out.values[channel, slots[channel, position].long()] = planes[channel, position]
    out.positions[channel, slots[channel, position].long()] = position.to(torch.int32)
    return out
