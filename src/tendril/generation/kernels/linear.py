"""Fused norm -> projection -> activation -> residual for a few rows (one-token decode steps), in one kernel.

At batch 1 a decode step's matrix products are matrix-vector products bound by reading the weights;
cuBLAS runs each as its own kernel, with the norm before it and the bias, activation and residual add
after it as more kernels. Here one kernel does all of it.

Work split. A program owns `BLOCK_N` output columns of `BLOCK_M` rows (all rows of a decode step up to
16, so the weights are read once for them) and a `1/SPLIT_K` share of the input features, streamed in
`[BLOCK_K, BLOCK_N]` weight tiles, two in flight. With `SPLIT_K > 1` each program stores its float32
partial sums, then counts its arrival on its block's counter (an acq_rel atomic, after a CTA barrier);
the last program of the block to arrive reads the `SPLIT_K` partials back in a fixed order (so results
do not depend on arrival order) and runs the epilogue, then resets the counter to zero for the next
launch. No second kernel, no memset per launch: the counters belong to the `Projection`
(`layers.SPLIT_K_LOCKS` of them). `launch.launch_config` chooses the split (see there).

Two paths for the products (`DOT`, chosen by `launch.launch_config`). One row (greedy decoding) is a
matrix-vector product: the CUDA-core path multiplies each input tile by its weight tile as a broadcast
product summed over K, for up to 4 rows (beams of a small projection too). Several rows of fp16/bf16 otherwise
take the tensor-core path: the rows padded to a 16-row block (the padding masked: never loaded, never stored) and
`tl.dot` accumulating in float32 (an MMA instruction takes 16 rows at once), in smaller tiles
(`launch.launch_config`).

Memory round trips. A batch-1 projection is a few microseconds, and most of it is waiting for memory, so
the kernel orders its loads to overlap. Under programmatic dependent launch (`pdl.py`) the first two
weight tiles of a program's share of K, the norm's gains (and bias) for them and the projection's bias load before
the program waits for the previous kernel; after the wait it loads the input's first two tiles, the addends
(residuals) and the input row for the norm's statistics together, the row in one load when it fits `STATS_BLOCK`
(over the rows there are, `STATS_M`, not the padded block). Its loop then loads every tile (weights, input,
gains) ahead of its use, so no load of the loop is a round trip on its critical path. A share of one or two tiles
is a compile-time constant (`SHARE_TILES`): the program then holds only the tiles it has, with no loop-carried
copies, which is what lets a one-row program hold a whole deep share in registers (`launch.ONE_ROW_TILE`).

Numerics. Accumulation is float32; bias, activation and addends are applied before the one store.
Rounding to the input's dtype happens where HF's eager forward rounds (see `reference.py`), so fp16
results track HF's closely, but the summation order differs from cuBLAS's: in fp16 the outputs are not
bit-identical to HF's. A float32 `out` receives the rounded result widened (the LM head's logits, as
HF's `.float()`). Both paths multiply DTYPE values (the normed input is rounded to DTYPE first, as HF's
norm output is) into float32 exactly; they differ only in the order of the float32 sums.

A projection may have up to three weight matrices whose outputs are concatenated (Llama's q, k and v):
the programs are split between them by their column blocks. `GATED` computes two matrices per program
and returns `act(first) * second` (Llama's gated MLP). Weights are `[out, in]` views with any strides
(GPT-2's Conv1D weights are read transposed, in place).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import pdl as programmatic
from tendril.generation.kernels.launch import DOT_MIN, launch_config, share_tiles
from tendril.generation.kernels.layers import ACTIVATIONS, SPLIT_K_LOCKS, Norm, Projection, sm_count

_NORMS = {None: 0, "layer": 1, "rms": 2}


@triton.jit
def _fused_linear_kernel(
    x_ptr,
    stride_xm,
    M,
    K,
    norm_w_ptr,
    norm_b_ptr,
    eps,
    w0_ptr,
    w1_ptr,
    w2_ptr,
    stride_wn,
    stride_wk,
    b0_ptr,
    b1_ptr,
    b2_ptr,
    N0,
    N1,
    N2,
    add0_ptr,
    stride_a0m,
    add1_ptr,
    stride_a1m,
    out_ptr,
    stride_om,
    partial_ptr,
    counter_ptr,
    NORM: tl.constexpr,
    HAS_NORM_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ADDENDS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SPLIT_K_POW2: tl.constexpr,
    SHARE_TILES: tl.constexpr,
    DOT: tl.constexpr,
    STATS_M: tl.constexpr,
    STATS_BLOCK: tl.constexpr,
    STATS_ONE_LOAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    row_group = tl.program_id(2)
    DTYPE = x_ptr.dtype.element_ty
    rows = row_group * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_mask = rows < M
    x_rows_ptr = x_ptr + rows[:, None] * stride_xm  # [BLOCK_M, 1]

    # which weight matrix (segment) this program's columns belong to; GATED reads w0 and w1 together
    blocks0 = (N0 + BLOCK_N - 1) // BLOCK_N
    blocks1 = (N1 + BLOCK_N - 1) // BLOCK_N
    w_ptr, b_ptr, n_size, block, col0 = w0_ptr, b0_ptr, N0, pid_n, pid_n * 0
    if not GATED:
        if pid_n >= blocks0 + blocks1:
            w_ptr, b_ptr, n_size, block, col0 = w2_ptr, b2_ptr, N2, pid_n - blocks0 - blocks1, N0 + N1
        elif pid_n >= blocks0:
            w_ptr, b_ptr, n_size, block, col0 = w1_ptr, b1_ptr, N1, pid_n - blocks0, N0
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns within the segment
    n_mask = offs_n < n_size

    # this program's share of K: whole tiles, the last share possibly shorter; a share of one or two tiles is
    # known when compiling (SHARE_TILES), so the compiler holds no loop-carried tiles for it
    tiles_per_split = SHARE_TILES if SHARE_TILES <= 2 else ((K + BLOCK_K - 1) // BLOCK_K + SPLIT_K - 1) // SPLIT_K
    k_begin = split * tiles_per_split * BLOCK_K
    k_end = tl.minimum(k_begin + tiles_per_split * BLOCK_K, K)

    # weights never change during a decode: the share's first two tiles load before waiting for the previous
    # kernel, and the loop keeps two tiles in flight (a tile past the share is fully masked: no memory traffic).
    # Only tiles the share has are held: a tile held for nothing would take registers all the same.
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    offs_k = k_begin + tl.arange(0, BLOCK_K)  # [BLOCK_K]
    w_offsets = offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    tile_mask = (offs_k < k_end)[:, None] & n_mask[None, :]
    next_mask = (offs_k + BLOCK_K < k_end)[:, None] & n_mask[None, :]
    w = tl.load(w_ptr + w_offsets, mask=tile_mask, other=0.0)
    w_next = w
    if SHARE_TILES > 1:
        w_next = tl.load(w_ptr + w_offsets + BLOCK_K * stride_wk, mask=next_mask, other=0.0)
    w_up = w
    w_up_next = w_next
    if GATED:
        w_up = tl.load(w1_ptr + w_offsets, mask=tile_mask, other=0.0)
        w_up_next = w_up
        if SHARE_TILES > 1:
            w_up_next = tl.load(w1_ptr + w_offsets + BLOCK_K * stride_wk, mask=next_mask, other=0.0)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    bias_up = bias
    if HAS_BIAS:
        bias = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        if GATED:
            bias_up = tl.load(b1_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    # the norm's gains (and LayerNorm's bias) for the same two tiles: constants too, so off the critical path
    k_mask, next_k_mask = offs_k < k_end, offs_k + BLOCK_K < k_end
    gain = tl.zeros([BLOCK_K], dtype=tl.float32)
    gain_next, shift, shift_next = gain, gain, gain
    if NORM != 0:
        gain = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if SHARE_TILES > 1:
            gain_next = tl.load(norm_w_ptr + offs_k + BLOCK_K, mask=next_k_mask, other=0.0).to(tl.float32)
    if NORM == 1 and HAS_NORM_BIAS:
        shift = tl.load(norm_b_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if SHARE_TILES > 1:
            shift_next = tl.load(norm_b_ptr + offs_k + BLOCK_K, mask=next_k_mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()  # everything below may read what earlier kernels wrote

    # the input's first two tiles with the addends, so that every load of the loop is a tile ahead of its use
    x = tl.load(x_rows_ptr + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
    x_next = x
    if SHARE_TILES > 1:
        x_next = tl.load(x_rows_ptr + offs_k[None, :] + BLOCK_K, mask=m_mask[:, None] & next_k_mask[None, :],
                         other=0.0)

    # the addends now, so their loads overlap the input's (each load is a round trip to L2)
    cols = col0 + offs_n
    out_mask = m_mask[:, None] & n_mask[None, :]  # [BLOCK_M, BLOCK_N]
    add0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    add1 = add0
    if ADDENDS >= 1:
        add0 = tl.load(add0_ptr + rows[:, None] * stride_a0m + cols[None, :], mask=out_mask, other=0.0)
    if ADDENDS >= 2:
        add1 = tl.load(add1_ptr + rows[:, None] * stride_a1m + cols[None, :], mask=out_mask, other=0.0)

    # the norm's statistics per row, two-pass as PyTorch's (one load of each row when it fits STATS_BLOCK), over
    # the block's first STATS_M rows: all the rows there are (a tensor-core row block is mostly padding)
    stats_rows = row_group * BLOCK_M + tl.arange(0, STATS_M)
    stats_m_mask = stats_rows < M
    x_stats_ptr = x_ptr + stats_rows[:, None] * stride_xm  # [STATS_M, 1]
    mean = tl.zeros([STATS_M], dtype=tl.float32)
    rstd = tl.full([STATS_M], 1.0, dtype=tl.float32)
    if NORM != 0 and STATS_ONE_LOAD:
        offs_s = tl.arange(0, STATS_BLOCK)
        stats_mask = stats_m_mask[:, None] & (offs_s < K)[None, :]
        x_row = tl.load(x_stats_ptr + offs_s[None, :], mask=stats_mask, other=0.0).to(tl.float32)
        if NORM == 1:
            mean = tl.sum(x_row, axis=1) / K
        centered = tl.where(stats_mask, x_row - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / K + eps)
    elif NORM != 0:
        total = tl.zeros([STATS_M, STATS_BLOCK], dtype=tl.float32)
        if NORM == 1:
            for k0 in range(0, K, STATS_BLOCK):
                offs_s = k0 + tl.arange(0, STATS_BLOCK)
                stats_mask = stats_m_mask[:, None] & (offs_s < K)[None, :]
                total += tl.load(x_stats_ptr + offs_s[None, :], mask=stats_mask, other=0.0).to(tl.float32)
            mean = tl.sum(total, axis=1) / K
            total = tl.zeros([STATS_M, STATS_BLOCK], dtype=tl.float32)
        for k0 in range(0, K, STATS_BLOCK):
            offs_s = k0 + tl.arange(0, STATS_BLOCK)
            stats_mask = stats_m_mask[:, None] & (offs_s < K)[None, :]
            x_row = tl.load(x_stats_ptr + offs_s[None, :], mask=stats_mask, other=0.0).to(tl.float32)
            centered = tl.where(stats_mask, x_row - mean[:, None], 0.0)
            total += centered * centered
        rstd = 1.0 / tl.sqrt(tl.sum(total, axis=1) / K + eps)
    if NORM != 0 and STATS_M != BLOCK_M:  # widened to the row block, zero past STATS_M (rows past M)
        same_row = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, STATS_M)[None, :]
        mean = tl.sum(tl.where(same_row, mean[None, :], 0.0), axis=1)
        rstd = tl.sum(tl.where(same_row, rstd[None, :], 0.0), axis=1)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        if NORM == 1:  # LayerNorm, output rounded to DTYPE
            x = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * gain[None, :]
            if HAS_NORM_BIAS:
                x += shift[None, :]
            x = x.to(DTYPE)
        elif NORM == 2:  # RMSNorm: weight * (x * rstd).to(DTYPE), rounded
            x = (x.to(tl.float32) * rstd[:, None]).to(DTYPE).to(tl.float32)
            x = (x * gain[None, :]).to(DTYPE)
        if DOT:  # DTYPE products, exact in the float32 accumulator: only the summation order differs
            acc = tl.dot(x, w.to(DTYPE), acc)
            if GATED:
                acc_up = tl.dot(x, w_up.to(DTYPE), acc_up)
        else:
            x = x.to(tl.float32)
            acc += tl.sum(x[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
            if GATED:
                acc_up += tl.sum(x[:, :, None] * w_up.to(tl.float32)[None, :, :], axis=1)
        w, w_up, x, gain, shift = w_next, w_up_next, x_next, gain_next, shift_next
        if SHARE_TILES > 2:  # the tile after the next one
            ahead = offs_k + 2 * BLOCK_K
            ahead_mask = ahead < k_end
            w_offsets = offs_n[None, :] * stride_wn + ahead[:, None] * stride_wk
            tile_mask = ahead_mask[:, None] & n_mask[None, :]
            w_next = tl.load(w_ptr + w_offsets, mask=tile_mask, other=0.0)
            if GATED:
                w_up_next = tl.load(w1_ptr + w_offsets, mask=tile_mask, other=0.0)
            x_next = tl.load(x_rows_ptr + ahead[None, :], mask=m_mask[:, None] & ahead_mask[None, :], other=0.0)
            if NORM != 0:
                gain_next = tl.load(norm_w_ptr + ahead, mask=ahead_mask, other=0.0).to(tl.float32)
            if NORM == 1 and HAS_NORM_BIAS:
                shift_next = tl.load(norm_b_ptr + ahead, mask=ahead_mask, other=0.0).to(tl.float32)

    if SPLIT_K > 1:
        # partials [SPLIT_K, 1 + GATED, M, columns]; the block's last program to arrive sums them in split order
        columns = N0 if GATED else N0 + N1 + N2
        part_offsets = rows[:, None] * columns + cols[None, :]
        part_size = M * columns
        split_ptr = partial_ptr + split * (1 + GATED) * part_size
        tl.store(split_ptr + part_offsets, acc, mask=out_mask)
        if GATED:
            tl.store(split_ptr + part_size + part_offsets, acc_up, mask=out_mask)
        tl.debug_barrier()  # every thread's partials stored before the release below
        lock_ptr = counter_ptr + row_group * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(lock_ptr, 1, sem="acq_rel", scope="gpu")
        last = arrived == SPLIT_K - 1
        out_mask = out_mask & ((tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32) + arrived) == SPLIT_K - 1)
        splits = tl.arange(0, SPLIT_K_POW2)
        all_offsets = splits[:, None, None] * ((1 + GATED) * part_size) + part_offsets[None, :, :]
        all_mask = (splits < SPLIT_K)[:, None, None] & out_mask[None, :, :]
        acc = tl.sum(tl.load(partial_ptr + all_offsets, mask=all_mask, other=0.0, cache_modifier=".cg"), axis=0)
        if GATED:
            acc_up = tl.sum(tl.load(partial_ptr + part_size + all_offsets, mask=all_mask, other=0.0,
                                    cache_modifier=".cg"), axis=0)
        tl.store(lock_ptr, 0, mask=last)  # every program has arrived: ready for the next launch

    y = (acc + bias[None, :]).to(DTYPE).to(tl.float32)
    # the activation (inline: the interpreter re-patches triton.language on every nested jit call)
    if ACTIVATION == 1:  # gelu_tanh, with tanh(u) = 1 - 2 / (exp(2u) + 1)
        u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0))
    elif ACTIVATION == 2:  # gelu (erf)
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    elif ACTIVATION == 3:  # silu
        y = y / (1.0 + tl.exp(-y))
    elif ACTIVATION == 4:  # relu
        y = tl.maximum(y, 0.0)
    if GATED:  # act(gate) * up, each rounded
        up = acc_up + bias_up[None, :]
        y = y.to(DTYPE).to(tl.float32) * up.to(DTYPE).to(tl.float32)
    y = y.to(DTYPE).to(tl.float32)
    if ADDENDS >= 1:  # each sum rounded, as HF's residual adds
        y = (y + add0.to(tl.float32)).to(DTYPE).to(tl.float32)
    if ADDENDS >= 2:
        y = (y + add1.to(tl.float32)).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=out_mask)


@functools.lru_cache(maxsize=16)
def fused_linear(
    x: torch.Tensor,
    projection: Projection,
    *,
    norm: Norm | None = None,
    activation: str = "none",
    gated: bool = False,
    addends: Sequence[torch.Tensor] = (),
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    dot: bool | None = None,
    pdl: bool | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The Triton kernel of `reference.fused_linear` (same arguments); x is [rows, in] with unit column stride.
    `out` (or, when it is None, `out_dtype`) may be float32 for an fp16/bf16 x: the result is still rounded to
    x's dtype, then stored widened.
    `dot` chooses the tensor-core or the CUDA-core path (`launch_config`, which chooses when it is None; the
    block sizes of the tensor-core path must be at least `DOT_MIN`); `block_n`, `block_k`, `split_k` and
    `num_warps` override the rest of the launch configuration; `pdl` the programmatic dependent launch
    (`pdl.enabled`; never under the interpreter)."""
    rows, in_features = x.shape
    if in_features != projection.in_features or x.stride(1) != 1:
        raise ValueError(f"x must be [rows, {projection.in_features}] with contiguous rows, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(ACTIVATIONS)}")
    if len(addends) > 2:
        raise ValueError(f"at most 2 addends, got {len(addends)}")
    sizes = projection.out_sizes
    if gated and (len(sizes) != 2 or sizes[0] != sizes[1]):
        raise ValueError(f"gated projections take two weights of equal size, got sizes {sizes}")
    out_features = sizes[0] if gated else sum(sizes)
    for addend in addends:
        if addend.shape != (rows, out_features) or addend.stride(1) != 1:
            raise ValueError(f"addends must be [{rows}, {out_features}] with contiguous rows, got "
                             f"{tuple(addend.shape)}")
    if out is None:
        out = torch.empty(rows, out_features, dtype=out_dtype or x.dtype, device=x.device)
    if out.shape != (rows, out_features) or out.stride(1) != 1 or out.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"the output must be a {x.dtype} or float32 [{rows}, {out_features}] tensor with contiguous "
                         f"rows, got {out.dtype} {tuple(out.shape)} strides {out.stride()}")
    pdl = programmatic.resolve(pdl, x.device, _fused_linear_kernel)
    read = projection.weights_for(rows)
    weights = list(read) + [read[0]] * (3 - len(sizes))
    biases = [b if b is not None else weights[0] for b in projection.biases]
    biases += [biases[0]] * (3 - len(biases))
    padded = list(sizes) + [0] * (3 - len(sizes))
    config = launch_config(sum(sizes), in_features, rows, k_contiguous=weights[0].stride(1) == 1,
                           element_size=weights[0].element_size(), sm_count=sm_count(x.device),
                           half_inputs=x.dtype in (torch.float16, torch.bfloat16) and weights[0].dtype == x.dtype,
                           normed=norm is not None, dot=dot, matrices=2 if gated else 1)
    block_n, block_k = block_n or config.block_n, block_k or config.block_k
    if config.dot and min(block_n, block_k) < DOT_MIN:
        raise ValueError(f"block_n={block_n}, block_k={block_k}: the tensor-core path needs both at least {DOT_MIN} "
                         "(or dot=False)")
    split_k = split_k or (config.split_k if (block_n, block_k) == (config.block_n, config.block_k) else 1)
    blocks = triton.cdiv(sizes[0], block_n) if gated else sum(triton.cdiv(n, block_n) for n in sizes)
    groups = triton.cdiv(rows, config.block_m)
    split_k = min(split_k, triton.cdiv(in_features, block_k))
    if split_k > 1 and blocks * groups > SPLIT_K_LOCKS:
        raise ValueError(f"split_k={split_k} needs {blocks * groups} counters (column blocks x row groups), more "
                         f"than the projection's {SPLIT_K_LOCKS}: use larger blocks or split_k=1")
    partials = out
    if split_k > 1:
        partials = torch.empty(split_k * (2 if gated else 1) * rows * out_features, dtype=torch.float32,
                               device=x.device)
    norm_w = norm.weight if norm is not None else x
    norm_b = norm.bias if norm is not None and norm.bias is not None else norm_w
    add0 = addends[0] if addends else out
    add1 = addends[1] if len(addends) > 1 else out
    stats_rows = min(triton.next_power_of_2(rows), config.block_m)  # the rows a row block holds at most
    stats_block = min(triton.next_power_of_2(in_features), 4096 // stats_rows)
    _fused_linear_kernel[(blocks, split_k, groups)](
        x, x.stride(0), rows, in_features,
        norm_w, norm_b, norm.eps if norm is not None else 0.0,
        weights[0], weights[1], weights[2], weights[0].stride(0), weights[0].stride(1),
        biases[0], biases[1], biases[2],
        padded[0], 0 if gated else padded[1], padded[2],
        add0, add0.stride(0), add1, add1.stride(0),
        out, out.stride(0),
        partials, projection.split_k_counters,
        NORM=_NORMS[norm.kind if norm is not None else None],
        HAS_NORM_BIAS=norm is not None and norm.bias is not None,
        HAS_BIAS=projection.biases[0] is not None,
        GATED=gated,
        ACTIVATION=ACTIVATIONS[activation],
        ADDENDS=len(addends),
        BLOCK_M=config.block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        SPLIT_K_POW2=triton.next_power_of_2(split_k),
        SHARE_TILES=min(share_tiles(in_features, block_k, split_k), 3),  # 3 stands for three or more
        DOT=config.dot,
        STATS_M=stats_rows,
        STATS_BLOCK=stats_block,
        STATS_ONE_LOAD=stats_block >= in_features,
        PDL=pdl,
        num_warps=num_warps or config.num_warps,
        launch_pdl=pdl,
    )
    return out
