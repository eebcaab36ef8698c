"""Activation compression on the GPU in two passes over segments of each phase plane.

A plane can hold 50,000 positions and a layer only a few channels, so one program per channel
would leave most of the GPU idle. Each virtual channel's plane is cut into segments of `SEGMENT`
positions; pass 1 counts the nonzeros of every (channel, segment), a cumulative sum (torch, on the
device) turns the counts into each segment's first slot, and pass 2 walks its segment in blocks,
reading the dense input through the padding and stride-phase indexing (nothing is materialised),
numbers the nonzeros with `tl.cumsum` on top of the segment's first slot, stores them in order and,
where a plane row starts, stores that row's pointer. Channels over capacity store only what fits;
their true counts are kept and the overflow flag is raised. No host sync: the launch shapes depend
only on the layout, so compression runs inside a CUDA graph. The values keep the activation's dtype (fp32, fp16
or bf16: the network's), so a half network compresses half values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.validation import VALUE_DTYPES


@triton.jit
def _plane_values(x_ptr, flat, v, height, width, plane_w, plane_size, STRIDE_H, STRIDE_W, PAD_H, PAD_W):
    channel = v // (STRIDE_H * STRIDE_W)
    phase = v % (STRIDE_H * STRIDE_W)
    iy = (flat // plane_w) * STRIDE_H + phase // STRIDE_W - PAD_H
    ix = (flat % plane_w) * STRIDE_W + phase % STRIDE_W - PAD_W
    inside = (flat < plane_size) & (iy >= 0) & (iy < height) & (ix >= 0) & (ix < width)
    return tl.load(x_ptr + channel * height * width + iy * width + ix, mask=inside, other=0.0)


@triton.jit
def _count_kernel(
    x_ptr,
    segment_counts_ptr,
    height,
    width,
    plane_w,
    plane_size,
    n_segments,
    STRIDE_H: tl.constexpr,
    STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr,
    PAD_W: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    v = tl.program_id(0)
    segment = tl.program_id(1)
    total = tl.full([], 0, tl.int32)
    for start in range(segment * SEGMENT, segment * SEGMENT + SEGMENT, BLOCK):
        flat = start + tl.arange(0, BLOCK)  # [BLOCK] plane positions
        x = _plane_values(x_ptr, flat, v, height, width, plane_w, plane_size, STRIDE_H, STRIDE_W, PAD_H, PAD_W)
        total += tl.sum((x != 0.0).to(tl.int32), axis=0)
    tl.store(segment_counts_ptr + v * n_segments + segment, total)


@triton.jit
def _compress_kernel(
    x_ptr,
    segment_starts_ptr,
    values_ptr,
    positions_ptr,
    row_ptr_ptr,
    height,
    width,
    plane_h,
    plane_w,
    plane_size,
    n_segments,
    capacity,
    STRIDE_H: tl.constexpr,
    STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr,
    PAD_W: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    v = tl.program_id(0)
    segment = tl.program_id(1)
    out_base = v * capacity
    total = tl.load(segment_starts_ptr + v * n_segments + segment)
    for start in range(segment * SEGMENT, segment * SEGMENT + SEGMENT, BLOCK):
        flat = start + tl.arange(0, BLOCK)  # [BLOCK] plane positions
        x = _plane_values(x_ptr, flat, v, height, width, plane_w, plane_size, STRIDE_H, STRIDE_W, PAD_H, PAD_W)
        nonzero = x != 0.0
        slot = total + tl.cumsum(nonzero.to(tl.int32), axis=0) - 1
        row_start = (flat < plane_size) & (flat % plane_w == 0)
        tl.store(row_ptr_ptr + v * (plane_h + 1) + flat // plane_w, slot + 1 - nonzero.to(tl.int32), mask=row_start)
        keep = nonzero & (slot < capacity)
        tl.store(values_ptr + out_base + slot, x, mask=keep)
        tl.store(positions_ptr + out_base + slot, flat, mask=keep)
        total += tl.sum(nonzero.to(tl.int32), axis=0)


def compress(
    x: torch.Tensor, layout: ActivationLayout, overflow: torch.Tensor, *, block: int = 1024, segment_blocks: int = 4
) -> CompressedActivations:
    """Compress dense `[C, H, W]` `x` (fp32, fp16 or bf16; the values keep its dtype) for a consumer with `layout`;
    `overflow` is an int32 flag."""
    h, w = layout.in_hw
    if x.dtype not in VALUE_DTYPES or tuple(x.shape) != (layout.channels, h, w):
        raise ValueError(
            f"x: expected a [{layout.channels}, {h}, {w}] activation of one of {VALUE_DTYPES}, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if overflow.dtype != torch.int32 or overflow.numel() != 1 or overflow.device != x.device:
        raise ValueError("overflow must be a one-element int32 tensor on the activation's device")
    x = x.contiguous()
    out = CompressedActivations.empty(layout, x.device, x.dtype)
    block = min(block, triton.next_power_of_2(layout.plane_size))
    segment = block * max(1, min(segment_blocks, triton.cdiv(layout.plane_size, block)))
    n_segments = triton.cdiv(layout.plane_size, segment)
    grid = (layout.virtual_channels, n_segments)
    geometry = (h, w, layout.plane_hw[1], layout.plane_size, n_segments)
    meta = {
        "STRIDE_H": layout.stride[0],
        "STRIDE_W": layout.stride[1],
        "PAD_H": layout.padding[0],
        "PAD_W": layout.padding[1],
        "SEGMENT": segment,
        "BLOCK": block,
    }
    segment_counts = torch.empty(layout.virtual_channels, n_segments, dtype=torch.int32, device=x.device)
    _count_kernel[grid](x, segment_counts, *geometry, **meta)
    torch.sum(segment_counts, dim=1, dtype=torch.int32, out=out.counts)
    segment_starts = torch.cumsum(segment_counts, dim=1, dtype=torch.int32) - segment_counts
    _compress_kernel[grid](
        x,
        segment_starts,
        out.values,
        out.positions,
        out.row_ptr,
        h,
        w,
        layout.plane_hw[0],
        *geometry[2:],
        layout.capacity,
        **meta,
    )
    out.row_ptr[:, layout.plane_hw[0]] = out.counts
    torch.maximum(overflow, (out.counts > layout.capacity).any().to(torch.int32), out=overflow)
    return out
