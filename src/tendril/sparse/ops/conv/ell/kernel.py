"""The `"ell"` convolution kernel: sparse weights (ELL chunks, `packing.py`) × dense activations on CUDA cores,
with bias, residual and ReLU fused, in the input's dtype (fp32, fp16 or bf16) with fp32 accumulation.

Grid: (channel tile, pixel block, sample). A program computes its tile's `channels` output channels at
`pixels` consecutive output pixels (row-major over the output plane). It walks its tile's chunks: each step
loads one chunk's `[depth, channels]` weights and offsets (the next chunk's are loaded one step ahead, so that
their latency hides behind the gather), gathers the `[depth, channels, pixels]` input values they read (for a
channel, a shifted run of the input's pixels: coalesced along the pixel axis) and accumulates their products in
a `[depth, channels, pixels]` fp32 accumulator, reduced over the depth once at the end. Every product but the
padding of the tile's ELL chunks is useful: work and input traffic follow the nonzero count, with one
gathered load per multiply-add (an input value is shared by two lanes only when two channels of a tile hold
the same tap, which unstructured pruning makes rare); weights and offsets are loaded once per `pixels`
products.

The input is read zero-padded by the layer's padding (one `F.pad` copy for padded layers; none for the others),
so the inner loop has no bounds checks; pixels past the output plane read pixel 0 and are not stored. Pointwise
layers (1×1, stride 1, no padding) read a channel's pixel run as contiguous memory instead, masked at the end of
the plane: Triton then knows the run's alignment where the plane size is a multiple of 16 and loads it in
vectors, a fraction of a load instruction per multiply-add. The
epilogue adds the bias and the residual, applies ReLU and stores in the input's dtype, undoing the tile's
channel order. On the CPU (tests, CPU networks) `conv` runs the PyTorch emulation of the same algorithm
(`emulation.py`), unless the Triton interpreter runs the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tendril import config
from tendril.sparse.ops.conv.ell import emulation
from tendril.sparse.ops.conv.ell.packing import EllConvWeights, padded_hw


@triton.jit
def _ell_conv_kernel(
    x_ptr,
    out_ptr,
    bias_ptr,
    residual_ptr,
    values_ptr,
    offsets_ptr,
    chunk_ptr,
    channels_ptr,
    x_sample,
    plane,
    out_channels,
    out_pixels,
    out_w,
    row_step,
    col_step,
    HAS_RESIDUAL: tl.constexpr,
    RELU: tl.constexpr,
    POINTWISE: tl.constexpr,
    CHANNELS: tl.constexpr,
    DEPTH: tl.constexpr,
    PIXELS: tl.constexpr,
):
    tile = tl.program_id(0)
    p = tl.program_id(1) * PIXELS + tl.arange(0, PIXELS)
    sample = tl.program_id(2).to(tl.int64)
    in_plane = p < out_pixels
    # pointwise: contiguous, so that with a plane size divisible by 16 the loads vectorise (masked at the end)
    base = p if POINTWISE else tl.where(in_plane, (p // out_w) * row_step + (p % out_w) * col_step, 0)
    x_sample_ptr = x_ptr + sample * x_sample
    entry = tl.arange(0, DEPTH)[:, None] * CHANNELS + tl.arange(0, CHANNELS)[None, :]  # [DEPTH, CHANNELS]
    first = tl.load(chunk_ptr + tile)
    last = tl.load(chunk_ptr + tile + 1)
    w = tl.load(values_ptr + first * (DEPTH * CHANNELS) + entry)
    offset = tl.load(offsets_ptr + first * (DEPTH * CHANNELS) + entry)
    acc = tl.zeros([DEPTH, CHANNELS, PIXELS], dtype=tl.float32)
    for chunk in range(first, last):
        if POINTWISE:
            read = x_sample_ptr + (offset * plane)[:, :, None] + base[None, None, :]
            x = tl.load(read, mask=in_plane[None, None, :], other=0.0).to(tl.float32)
        else:
            x = tl.load(x_sample_ptr + offset[:, :, None] + base[None, None, :]).to(tl.float32)
        following = (chunk + 1) * (DEPTH * CHANNELS) + entry
        w_next = tl.load(values_ptr + following)
        offset_next = tl.load(offsets_ptr + following)
        acc += w[:, :, None] * x
        w = w_next
        offset = offset_next
    y = tl.sum(acc, axis=0)  # [CHANNELS, PIXELS]

    channel = tl.load(channels_ptr + tile * CHANNELS + tl.arange(0, CHANNELS))
    used = channel >= 0
    k = tl.where(used, channel, 0)
    y += tl.load(bias_ptr + k).to(tl.float32)[:, None]
    out_offset = (sample * out_channels + k[:, None]) * out_pixels + p[None, :]
    mask = used[:, None] & in_plane[None, :]
    if HAS_RESIDUAL:
        y += tl.load(residual_ptr + out_offset, mask=mask, other=0.0).to(tl.float32)
    if RELU:
        y = tl.maximum(y, 0.0)
    tl.store(out_ptr + out_offset, y.to(out_ptr.dtype.element_ty), mask=mask)


def conv(
    x: torch.Tensor,
    packed: EllConvWeights,
    bias: torch.Tensor,
    residual: torch.Tensor | None = None,
    relu: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`relu(conv2d(x, weights) + bias + residual)` for a batch `x` (`[N, C, H, W]`, fp32, fp16 or bf16), in
    `x`'s dtype; `residual` (`[N, K, OH, OW]`) and `bias` (`[K]`) in any float dtype. Written into `out`
    (contiguous, `x`'s dtype) where given, else into a new tensor."""
    g, cfg = packed.geometry, packed.config
    if x.dim() != 4 or tuple(x.shape[1:]) != (g.in_channels, *g.in_hw):
        raise ValueError(f"x: expected [N, {g.in_channels}, {g.in_hw[0]}, {g.in_hw[1]}], got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"x: expected float32, float16 or bfloat16, got {x.dtype}")
    if x.device != packed.values.device:
        raise ValueError(f"x is on {x.device}, the packed weights on {packed.values.device}")
    out_shape = (x.shape[0], g.out_channels, *g.out_hw)
    if bias.shape != (g.out_channels,):
        raise ValueError(f"bias: expected shape ({g.out_channels},), got {tuple(bias.shape)}")
    if residual is not None and tuple(residual.shape) != out_shape:
        raise ValueError(f"residual: expected shape {out_shape}, got {tuple(residual.shape)}")
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != out_shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out: expected a contiguous {x.dtype} tensor of shape {out_shape} on {x.device}")
    if x.device.type == "cpu" and not config.settings.triton_interpret:
        return out.copy_(emulation.conv(x, packed, bias, residual=residual, relu=relu))
    (ph, pw), (hp, wp) = g.padding, padded_hw(g)
    x = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x.contiguous()
    pixels = g.out_hw[0] * g.out_hw[1]
    grid = (packed.tiles, triton.cdiv(pixels, cfg.pixels), x.shape[0])
    _ell_conv_kernel[grid](
        x,
        out,
        bias.contiguous(),
        out if residual is None else residual.contiguous(),
        packed.values,
        packed.offsets,
        packed.chunk_ptr,
        packed.channels,
        g.in_channels * hp * wp,
        hp * wp,
        g.out_channels,
        pixels,
        g.out_hw[1],
        g.stride[0] * wp,
        g.stride[1],
        HAS_RESIDUAL=residual is not None,
        RELU=relu,
        POINTWISE=packed.pointwise,
        CHANNELS=cfg.channels,
        DEPTH=cfg.depth,
        PIXELS=cfg.pixels,
        num_warps=cfg.warps,
    )
    return out
