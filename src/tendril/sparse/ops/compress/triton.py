"""Activation compression on the GPU: one program per virtual channel, a running prefix sum over blocks.

Each program walks its phase plane in blocks of `BLOCK` positions, reading the dense input through
the padding and stride-phase indexing (nothing is materialised), numbers the nonzeros of the block
with `tl.cumsum` on top of the running count and stores them in order; where a plane row starts it
stores the running count as that row's pointer. The true count goes to
`counts`; a channel over capacity stores only what fits and raises `overflow_ptr[0]`. No host sync:
the launch shape depends only on the layout, so it runs inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.sparse.format import ActivationLayout, CompressedActivations


@triton.jit
def _compress_kernel(
    x_ptr,
    values_ptr,
    positions_ptr,
    row_ptr_ptr,
    counts_ptr,
    overflow_ptr,
    height,
    width,
    plane_h,
    plane_w,
    plane_size,
    capacity,
    STRIDE_H: tl.constexpr,
    STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr,
    PAD_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    v = tl.program_id(0)
    channel = v // (STRIDE_H * STRIDE_W)
    phase = v % (STRIDE_H * STRIDE_W)
    phase_y = phase // STRIDE_W
    phase_x = phase % STRIDE_W
    x_base = x_ptr + channel * height * width
    out_base = v * capacity
    total = tl.full([], 0, tl.int32)
    for start in range(0, plane_size, BLOCK):
        flat = start + tl.arange(0, BLOCK)  # [BLOCK] plane positions
        iy = (flat // plane_w) * STRIDE_H + phase_y - PAD_H
        ix = (flat % plane_w) * STRIDE_W + phase_x - PAD_W
        inside = (flat < plane_size) & (iy >= 0) & (iy < height) & (ix >= 0) & (ix < width)
        x = tl.load(x_base + iy * width + ix, mask=inside, other=0.0)
        nonzero = inside & (x != 0.0)
        slot = total + tl.cumsum(nonzero.to(tl.int32), axis=0) - 1
        row_start = (flat < plane_size) & (flat % plane_w == 0)
        tl.store(row_ptr_ptr + v * (plane_h + 1) + flat // plane_w, slot + 1 - nonzero.to(tl.int32), mask=row_start)
        keep = nonzero & (slot < capacity)
        tl.store(values_ptr + out_base + slot, x, mask=keep)
        tl.store(positions_ptr + out_base + slot, flat, mask=keep)
        total += tl.sum(nonzero.to(tl.int32), axis=0)
    tl.store(counts_ptr + v, total)
    tl.store(row_ptr_ptr + v * (plane_h + 1) + plane_h, total)
    tl.atomic_max(overflow_ptr, (total > capacity).to(tl.int32))


def compress(
    x: torch.Tensor, layout: ActivationLayout, overflow: torch.Tensor, *, block: int = 1024
) -> CompressedActivations:
    """Compress dense `[C, H, W]` fp32 `x` for a consumer with `layout`; `overflow` is an int32 flag."""
    h, w = layout.in_hw
    if x.dtype != torch.float32 or tuple(x.shape) != (layout.channels, h, w):
        raise ValueError(f"expected a float32 [{layout.channels}, {h}, {w}] activation, got {x.dtype} {tuple(x.shape)}")
    if overflow.dtype != torch.int32 or overflow.numel() != 1 or overflow.device != x.device:
        raise ValueError("overflow must be a one-element int32 tensor on the activation's device")
    x = x.contiguous()
    out = CompressedActivations.empty(layout, x.device)
    _compress_kernel[(layout.virtual_channels,)](
        x,
        out.values,
        out.positions,
        out.row_ptr,
        out.counts,
        overflow,
        h,
        w,
        layout.plane_hw[0],
        layout.plane_hw[1],
        layout.plane_size,
        layout.capacity,
        STRIDE_H=layout.stride[0],
        STRIDE_W=layout.stride[1],
        PAD_H=layout.padding[0],
        PAD_W=layout.padding[1],
        BLOCK=min(block, triton.next_power_of_2(layout.plane_size)),
    )
    return out
