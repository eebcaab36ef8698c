"""Activation compression on the GPU: one kernel when each phase plane fits one segment, two otherwise.

A plane can hold 50,000 positions and a layer only a few channels, so one program per channel
would leave most of the GPU idle. Each virtual channel's plane is cut into segments of `SEGMENT`
positions and each (channel, segment) gets a program. The compress pass walks its segment in blocks,
reading the dense input through the padding and stride-phase indexing (nothing is materialised),
numbers the nonzeros with `tl.cumsum` on top of the segment's first slot, stores them in order and,
where a plane row starts, stores that row's pointer. When a plane fits one segment, that first slot
is 0 and the walk itself finds the channel's count: compression is a single launch. Otherwise a count
pass first stores every segment's nonzero count, and each compress program sums the counts of its
channel's earlier segments for its first slot (and all of them for the channel's count).

A small layer's compression costs little more than its launches, so no other kernel runs: the program of a
channel's first segment stores its count, the final row pointer (the count) and, if the count exceeds
the capacity, sets the overflow flag to 1 (never lowering it: the flag accumulates over a network's
layers). Channels over capacity store only what fits and keep their true count. No host sync: the
launch shapes depend only on the layout, so compression runs inside a CUDA graph. The values keep the
activation's dtype (fp32, fp16 or bf16: the network's), so a half network compresses half values.
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
    segment_counts_ptr,
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
    n_segments,
    capacity,
    STRIDE_H: tl.constexpr,
    STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr,
    PAD_W: tl.constexpr,
    SEGMENT: tl.constexpr,
    BLOCK: tl.constexpr,
    PADDED_SEGMENTS: tl.constexpr,
):
    """`PADDED_SEGMENTS` is `n_segments` rounded up to a power of two; at 1 `segment_counts_ptr` is not read."""
    v = tl.program_id(0)
    segment = tl.program_id(1)
    out_base = v * capacity
    if PADDED_SEGMENTS > 1:  # the count pass ran: this segment's slots follow the earlier segments'
        others = tl.arange(0, PADDED_SEGMENTS)
        counts = tl.load(segment_counts_ptr + v * n_segments + others, mask=others < n_segments, other=0)
        total = tl.sum(tl.where(others < segment, counts, 0), axis=0)
        channel_count = tl.sum(counts, axis=0)
    else:
        total = tl.full([], 0, tl.int32)
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
    if PADDED_SEGMENTS == 1:
        channel_count = total
    first = segment == 0
    tl.store(counts_ptr + v, channel_count, mask=first)
    tl.store(row_ptr_ptr + v * (plane_h + 1) + plane_h, channel_count, mask=first)
    tl.store(overflow_ptr, 1, mask=first & (channel_count > capacity))


def compress(
    x: torch.Tensor, layout: ActivationLayout, overflow: torch.Tensor, *, block: int = 1024, segment_blocks: int = 4
) -> CompressedActivations:
    """Compress dense `[C, H, W]` `x` (fp32, fp16 or bf16; the values keep its dtype) for a consumer with `layout`;
    `overflow` is an int32 flag, set to 1 if a channel exceeds the capacity. A segment is `segment_blocks` blocks
    of `block` positions (both capped by the plane's size)."""
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
    segment_counts = out.counts  # a placeholder the single-segment kernel never reads
    if n_segments > 1:
        segment_counts = torch.empty(layout.virtual_channels, n_segments, dtype=torch.int32, device=x.device)
        _count_kernel[grid](x, segment_counts, *geometry, **meta)
    _compress_kernel[grid](
        x,
        segment_counts,
        out.values,
        out.positions,
        out.row_ptr,
        out.counts,
        overflow,
        h,
        w,
        layout.plane_hw[0],
        *geometry[2:],
        layout.capacity,
        PADDED_SEGMENTS=triton.next_power_of_2(n_segments),
        **meta,
    )
    return out
