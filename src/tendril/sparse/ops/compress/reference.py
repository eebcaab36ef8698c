"""Plain-PyTorch reference of activation compression and decompression (see `format.py` for the layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tendril.sparse.activations import ActivationLayout, CompressedActivations


def phase_planes(x: torch.Tensor, layout: ActivationLayout) -> torch.Tensor:
    """Dense `[C, H, W]` -> `[Cv, plane_h * plane_w]`: padded, split into stride phases, flattened."""
    (sh, sw), (ph, pw) = layout.stride, layout.padding
    (hv, wv), (h, w) = layout.plane_hw, layout.in_hw
    if tuple(x.shape) != (layout.channels, h, w):
        raise ValueError(f"activation shape {tuple(x.shape)}: the layout expects {(layout.channels, h, w)}")
    padded = F.pad(x, (pw, wv * sw - w - pw, ph, hv * sh - h - ph))
    planes = padded.reshape(layout.channels, hv, sh, wv, sw).permute(0, 2, 4, 1, 3)
    return planes.reshape(layout.virtual_channels, hv * wv)


def compress(x: torch.Tensor, layout: ActivationLayout) -> CompressedActivations:
    """Channel by channel with `nonzero`: the obviously correct version the kernels are checked against."""
    planes = phase_planes(x, layout)
    out = CompressedActivations.empty(layout, x.device, x.dtype)
    out.values.zero_()
    out.positions.zero_()
    for v in range(layout.virtual_channels):
        nz = planes[v].nonzero().flatten()
        kept = nz[: layout.capacity]
        out.values[v, : kept.numel()] = planes[v, kept]
        out.positions[v, : kept.numel()] = kept.to(torch.int32)
        out.counts[v] = nz.numel()
    rows = (planes != 0).reshape(layout.virtual_channels, layout.plane_hw[0], layout.plane_hw[1]).sum(2)
    out.row_ptr[:, 0] = 0
    out.row_ptr[:, 1:] = torch.cumsum(rows, 1)
    return out


def decompress(acts: CompressedActivations) -> torch.Tensor:
    """Back to dense `[C, H, W]` (only the stored entries; an overflowed channel loses the rest)."""
    layout = acts.layout
    (sh, sw), (ph, pw) = layout.stride, layout.padding
    (hv, wv), (h, w) = layout.plane_hw, layout.in_hw
    planes = torch.zeros(layout.virtual_channels, hv * wv, dtype=acts.values.dtype, device=acts.values.device)
    slots = torch.arange(layout.capacity, device=acts.values.device)
    valid = slots[None, :] < acts.stored_counts[:, None]
    rows = torch.arange(layout.virtual_channels, device=acts.values.device)[:, None].expand_as(valid)
    planes[rows[valid], acts.positions[valid].long()] = acts.values[valid]
    padded = (
        planes.reshape(layout.channels, sh, sw, hv, wv)
        .permute(0, 3, 1, 4, 2)
        .reshape(layout.channels, hv * sh, wv * sw)
    )
    return padded[:, ph : ph + h, pw : pw + w].contiguous()
