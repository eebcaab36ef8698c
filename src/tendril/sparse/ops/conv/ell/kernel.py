"""The `"ell"` convolution kernel: sparse weights (ELL chunks, `packing.py`) × dense activations on CUDA cores,
with bias, residual and ReLU fused, in the input's dtype (fp32, fp16 or bf16) with fp32 accumulation.

Grid: (channel tile, pixel block, sample). A program computes its tile's `channels` output channels at
`pixels` consecutive pixels of the plane its reading mode computes (`planes.py`: the output plane, or for
`SHIFTED` layers a virtual plane whose extra columns are computed and not stored). It walks its tile's chunks:
each step loads one chunk's `[depth, channels]` weights and offsets (the next chunk's one step ahead, so their
latency hides behind the gather), gathers the input values they read for every pixel (for one nonzero, a run
of `RUN` consecutive input pixels on neighbouring lanes, `EllConfig.run`) and accumulates the products in a
`[pixels / RUN, depth, channels, RUN]` fp32 accumulator, reduced over the depth once at the end. Every product
but the padding of the tile's ELL chunks is useful, so work and input traffic follow the nonzero count.

Cost per step and thread: one gathered load, one conversion to fp32 (none for fp32) and one multiply-add per
product; the weight and offset of a nonzero are loaded once for the thread's `pixels / RUN` products of it; an
input value is shared between lanes only when two channels of a tile hold the same tap (rare under unstructured
pruning). Addresses cost nearly nothing: every pixel sits at the same distance from its entry's offset, so a
thread's loads of a nonzero are one address plus immediate offsets (`SHIFTED`), or 16-byte vectors where the
plane size is a multiple of 16 (`POINTWISE`). The reads need no bounds checks (`planes.input_planes` makes the
planes: one copy for padded or strided layers, none for the others).

The epilogue adds the bias and the residual, applies ReLU and stores the real output pixels in the input's dtype,
undoing the tile's channel order. On the CPU (tests, CPU networks) `conv` runs the PyTorch emulation of the same
algorithm (`emulation.py`), unless the Triton interpreter runs the kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril import config
from tendril.sparse.ops.conv.ell import emulation
from tendril.sparse.ops.conv.ell.packing import EllConvWeights
from tendril.sparse.ops.conv.ell.planes import input_planes, plane_hw, virtual_width


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
    partial_ptr,
    ticket_ptr,
    x_sample,
    plane,
    virtual_pixels,
    virtual_w,
    out_channels,
    out_h,
    out_w,
    HAS_RESIDUAL: tl.constexpr,
    RELU: tl.constexpr,
    MODE: tl.constexpr,
    CHANNELS: tl.constexpr,
    DEPTH: tl.constexpr,
    PIXELS: tl.constexpr,
    RUN: tl.constexpr,
    SPLITS: tl.constexpr,
):
    tile = tl.program_id(0) // SPLITS
    split = tl.program_id(0) % SPLITS
    block = tl.program_id(1)
    runs = tl.arange(0, PIXELS // RUN)[:, None] * RUN  # [RUNS, 1]: a program's pixels are runs of RUN
    q = block * PIXELS + runs + tl.arange(0, RUN)[None, :]  # [RUNS, RUN] virtual pixels
    sample = tl.program_id(2).to(tl.int64)
    in_plane = q < virtual_pixels
    x_sample_ptr = x_ptr + sample * x_sample
    entry = tl.arange(0, DEPTH)[:, None] * CHANNELS + tl.arange(0, CHANNELS)[None, :]  # [DEPTH, CHANNELS]
    first = tl.load(chunk_ptr + tile)
    count = tl.load(chunk_ptr + tile + 1) - first
    share = (count + SPLITS - 1) // SPLITS
    start = first + tl.minimum(split * share, count)
    stop = first + tl.minimum(split * share + share, count)
    w = tl.load(values_ptr + start * (DEPTH * CHANNELS) + entry)
    offset = tl.load(offsets_ptr + start * (DEPTH * CHANNELS) + entry)
    acc = tl.zeros([PIXELS // RUN, DEPTH, CHANNELS, RUN], dtype=tl.float32)
    for chunk in range(start, stop):
        if MODE == 0:  # POINTWISE: masked at the end of the plane
            read = x_sample_ptr + (offset * plane)[None, :, :, None] + q[:, None, None, :]
            x = tl.load(read, mask=in_plane[:, None, None, :], other=0.0).to(tl.float32)
        else:  # SHIFTED: inside the slack rows
            x = tl.load(x_sample_ptr + offset[None, :, :, None] + q[:, None, None, :]).to(tl.float32)
        following = (chunk + 1) * (DEPTH * CHANNELS) + entry
        w_next = tl.load(values_ptr + following)
        offset_next = tl.load(offsets_ptr + following)
        acc += w[None, :, :, None] * x
        w = w_next
        offset = offset_next
    y = tl.sum(acc, axis=1)  # [RUNS, CHANNELS, RUN]

    channel = tl.load(channels_ptr + tile * CHANNELS + tl.arange(0, CHANNELS))
    used = channel >= 0
    k = tl.where(used, channel, 0)[None, :, None]
    oy = q // virtual_w
    ox = q % virtual_w
    out_offset = (sample * out_channels + k) * (out_h * out_w) + (oy * out_w + ox)[:, None, :]
    mask = used[None, :, None] & ((oy < out_h) & (ox < out_w))[:, None, :]
    if SPLITS == 1:
        _epilogue(y, k, out_offset, mask, out_ptr, bias_ptr, residual_ptr, HAS_RESIDUAL, RELU)
    else:
        # this split's partial sums, then a ticket: the last of the tile's splits to take one sums them all in
        # split order (deterministic) and stores the output
        tiles = tl.num_programs(0) // SPLITS
        slot = (sample * tiles + tile) * tl.num_programs(1) + block
        local = (tl.arange(0, PIXELS // RUN)[:, None, None] * CHANNELS + tl.arange(0, CHANNELS)[None, :, None]) * RUN
        local += tl.arange(0, RUN)[None, None, :]  # [RUNS, CHANNELS, RUN]
        tl.store(partial_ptr + (slot * SPLITS + split) * (PIXELS * CHANNELS) + local, y)
        tl.debug_barrier()  # every thread's partial sums are written before the ticket releases them
        ticket = tl.atomic_add(ticket_ptr + slot, 1, sem="acq_rel")
        if ticket == SPLITS - 1:
            total = tl.zeros([PIXELS // RUN, CHANNELS, RUN], dtype=tl.float32)
            for part in tl.static_range(SPLITS):
                read = partial_ptr + (slot * SPLITS + part) * (PIXELS * CHANNELS) + local
                total += tl.load(read, cache_modifier=".cg")
            _epilogue(total, k, out_offset, mask, out_ptr, bias_ptr, residual_ptr, HAS_RESIDUAL, RELU)


@triton.jit
def _epilogue(y, k, out_offset, mask, out_ptr, bias_ptr, residual_ptr, HAS_RESIDUAL: tl.constexpr, RELU: tl.constexpr):
    """Bias, residual and ReLU on the fp32 sums `y`, stored in the output's dtype where `mask` holds."""
    y += tl.load(bias_ptr + k).to(tl.float32)
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
    x = input_planes(x, g)
    rows, cols = plane_hw(g)
    (oh, ow), vw = g.out_hw, virtual_width(g)
    grid = (packed.tiles * cfg.splits, triton.cdiv(oh * vw, cfg.pixels), x.shape[0])
    slots = packed.tiles * grid[1] * grid[2]
    if cfg.splits > 1:  # partial sums need no initial value; tickets start at zero on every call (graph replays)
        partial = torch.empty(slots * cfg.splits * cfg.channels * cfg.pixels, dtype=torch.float32, device=x.device)
        tickets = torch.zeros(slots, dtype=torch.int32, device=x.device)
    else:
        partial, tickets = out, packed.chunk_ptr  # not read
    _ell_conv_kernel[grid](
        x,
        out,
        bias.contiguous(),
        out if residual is None else residual.contiguous(),
        packed.values,
        packed.offsets,
        packed.chunk_ptr,
        packed.channels,
        partial,
        tickets,
        x[0].numel(),
        rows * cols,
        oh * vw,
        vw,
        g.out_channels,
        oh,
        ow,
        HAS_RESIDUAL=residual is not None,
        RELU=relu,
        MODE=packed.mode,
        CHANNELS=cfg.channels,
        DEPTH=cfg.depth,
        PIXELS=cfg.pixels,
        RUN=cfg.run,
        SPLITS=cfg.splits,
        num_warps=cfg.warps,
    )
    return out
