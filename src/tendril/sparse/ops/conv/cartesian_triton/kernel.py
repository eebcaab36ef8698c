"""Sparse×sparse convolution on the GPU in SCNN's Cartesian-product dataflow.

Grid: (virtual input channel, block of `BLOCK_A` of its stored nonzero activations). A program
loads its activations once, then walks the channel's nonzero weights `BLOCK_W` at a time; every
weight meets every activation (the [BLOCK_W, BLOCK_A] outer product, all products useful thanks to
the phase-plane rewrite of stride), and each product is added to output `(k, iy - r', ix - s')`,
an address that is the sum of a weight part and an activation part. Products that fall outside the
output (the halo of a border activation) are masked. Accumulation is by relaxed global atomics into
the dense output, which the caller initialises with bias (+ residual): one atomic per useful product,
coalesced along the activation axis because a channel's activations are stored in raster order.
Programs past a channel's count exit at once, so work follows the nonzero counts with a static grid
(no host sync; capturable). Values may be fp32, fp16 or bf16 (weights and activations alike): products and
atomics are fp32, into an fp32 accumulator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import SparseConvWeights


@triton.jit
def _scnn_conv_kernel(
    out_ptr,
    act_values_ptr,
    act_positions_ptr,
    act_counts_ptr,
    w_values_ptr,
    w_taps_ptr,
    w_channel_ptr,
    capacity,
    plane_w,
    out_h,
    out_w,
    BLOCK_A: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    v = tl.program_id(0)
    a_start = tl.program_id(1) * BLOCK_A
    count = tl.minimum(tl.load(act_counts_ptr + v), capacity)
    if a_start >= count:
        return
    offs_a = a_start + tl.arange(0, BLOCK_A)  # [BLOCK_A]
    mask_a = offs_a < count
    a = tl.load(act_values_ptr + v * capacity + offs_a, mask=mask_a, other=0.0).to(tl.float32)
    flat = tl.load(act_positions_ptr + v * capacity + offs_a, mask=mask_a, other=0)
    ay = flat // plane_w
    ax = flat % plane_w
    w_begin = tl.load(w_channel_ptr + v)
    w_end = tl.load(w_channel_ptr + v + 1)
    for w_start in range(w_begin, w_end, BLOCK_W):
        offs_w = w_start + tl.arange(0, BLOCK_W)  # [BLOCK_W]
        mask_w = offs_w < w_end
        w = tl.load(w_values_ptr + offs_w, mask=mask_w, other=0.0).to(tl.float32)
        tap = tl.load(w_taps_ptr + offs_w, mask=mask_w, other=0)
        k = tap >> 16
        oy = ay[None, :] - ((tap >> 8) & 0xFF)[:, None]  # [BLOCK_W, BLOCK_A]
        ox = ax[None, :] - (tap & 0xFF)[:, None]
        valid = mask_w[:, None] & mask_a[None, :] & (oy >= 0) & (oy < out_h) & (ox >= 0) & (ox < out_w)
        address = k[:, None] * (out_h * out_w) + oy * out_w + ox
        tl.atomic_add(out_ptr + address, w[:, None] * a[None, :], mask=valid, sem="relaxed")


def conv(
    acts: CompressedActivations,
    weights: SparseConvWeights,
    init: torch.Tensor,
    *,
    block_a: int = 128,
    block_w: int = 16,
) -> torch.Tensor:
    """`init + conv(acts, weights)`, accumulated in place into `init` (`[K, OH, OW]` fp32, whatever the values'
    dtype) and returned."""
    g = weights.geometry
    layout = acts.layout
    if layout.virtual_channels != g.virtual_channels or layout.plane_hw != g.plane_hw:
        raise ValueError("activations were compressed for a different convolution geometry")
    if tuple(init.shape) != (g.out_channels, *g.out_hw) or init.dtype != torch.float32 or not init.is_contiguous():
        raise ValueError(f"init must be a contiguous float32 {[g.out_channels, *g.out_hw]} tensor")
    if acts.values.dtype != weights.values.dtype:
        raise ValueError(f"activations are {acts.values.dtype}, the weights {weights.values.dtype}: convert both alike")
    if weights.nnz == 0:
        return init
    grid = (g.virtual_channels, triton.cdiv(layout.capacity, block_a))
    _scnn_conv_kernel[grid](
        init,
        acts.values,
        acts.positions,
        acts.counts,
        weights.values,
        weights.taps,
        weights.channel_ptr,
        layout.capacity,
        layout.plane_hw[1],
        g.out_hw[0],
        g.out_hw[1],
        BLOCK_A=block_a,
        BLOCK_W=block_w,
    )
    return init
