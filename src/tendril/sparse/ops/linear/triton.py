"""Sparse weights × sparse activations for fully-connected layers, natively (no conv mapping).

The activation vector is compressed (nonzero values and their feature indices); the weight is CSC,
so nonzero activation `j` meets exactly the nonzeros of column `j`: the Cartesian product of
the two operands restricted to matching `j`. A program takes `BLOCK_A` stored activations and walks
their columns together, `BLOCK_W` entries at a time up to the longest of them, adding each product
to its output row with a relaxed atomic. Zero activations cost nothing; zero weights are not stored.

`linear_rows` is the other way round: a row-wise gather over a CSR copy of the weight with the dense
input (`CsrLinearWeights`), no atomics, every stored weight read once. At batch 1 a layer is bound by
reading its weights, and one atomic per product keeps the Cartesian kernel far from that bound, so the
row kernel is usually faster on classifier layers. `SparseNetwork.tune` times both per layer.

Values (weights, activations, bias) may be fp32, fp16 or bf16; both kernels multiply and accumulate in fp32 (the
Cartesian one into an fp32 `init`, the row one in registers, storing its output in the input's dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import CsrLinearWeights, SparseLinearWeights


@triton.jit
def _spmspv_kernel(
    out_ptr,
    act_values_ptr,
    act_positions_ptr,
    act_counts_ptr,
    w_values_ptr,
    w_rows_ptr,
    w_col_ptr,
    capacity,
    BLOCK_A: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    a_start = tl.program_id(0) * BLOCK_A
    count = tl.minimum(tl.load(act_counts_ptr), capacity)
    if a_start >= count:
        return
    offs_a = a_start + tl.arange(0, BLOCK_A)  # [BLOCK_A]
    mask_a = offs_a < count
    a = tl.load(act_values_ptr + offs_a, mask=mask_a, other=0.0).to(tl.float32)
    feature = tl.load(act_positions_ptr + offs_a, mask=mask_a, other=0)
    col_begin = tl.load(w_col_ptr + feature, mask=mask_a, other=0)
    col_end = tl.load(w_col_ptr + feature + 1, mask=mask_a, other=0)
    longest = tl.max(col_end - col_begin, axis=0)
    for t in range(0, longest, BLOCK_W):
        entry = col_begin[:, None] + t + tl.arange(0, BLOCK_W)[None, :]  # [BLOCK_A, BLOCK_W]
        valid = entry < col_end[:, None]
        w = tl.load(w_values_ptr + entry, mask=valid, other=0.0).to(tl.float32)
        row = tl.load(w_rows_ptr + entry, mask=valid, other=0)
        tl.atomic_add(out_ptr + row, w * a[:, None], mask=valid, sem="relaxed")


def linear(
    acts: CompressedActivations,
    weights: SparseLinearWeights,
    init: torch.Tensor,
    *,
    block_a: int = 16,
    block_w: int = 64,
) -> torch.Tensor:
    """`init + W @ a`, accumulated in place into `init` (`[out_features]` fp32, whatever the values' dtype) and
    returned."""
    layout = acts.layout
    if layout.virtual_channels != 1 or layout.plane_size != weights.in_features:
        raise ValueError(f"activations hold {layout.plane_size} features, the weight expects {weights.in_features}")
    if tuple(init.shape) != (weights.out_features,) or init.dtype != torch.float32 or not init.is_contiguous():
        raise ValueError(f"init must be a contiguous float32 [{weights.out_features}] tensor")
    if acts.values.dtype != weights.values.dtype:
        raise ValueError(f"activations are {acts.values.dtype}, the weights {weights.values.dtype}: convert both alike")
    if weights.nnz == 0:
        return init
    grid = (triton.cdiv(layout.capacity, block_a),)
    _spmspv_kernel[grid](
        init,
        acts.values,
        acts.positions,
        acts.counts,
        weights.values,
        weights.rows,
        weights.col_ptr,
        layout.capacity,
        BLOCK_A=block_a,
        BLOCK_W=block_w,
    )
    return init


@triton.jit
def _csr_gemv_kernel(
    out_ptr,
    x_ptr,
    bias_ptr,
    w_values_ptr,
    w_cols_ptr,
    w_row_ptr,
    rows,
    RELU: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rows
    begin = tl.load(w_row_ptr + offs_r, mask=mask_r, other=0)
    end = tl.load(w_row_ptr + offs_r + 1, mask=mask_r, other=0)
    longest = tl.max(end - begin, axis=0)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for t in range(0, longest, BLOCK_K):
        entry = begin[:, None] + t + tl.arange(0, BLOCK_K)[None, :]  # [BLOCK_R, BLOCK_K]
        valid = entry < end[:, None]
        w = tl.load(w_values_ptr + entry, mask=valid, other=0.0).to(tl.float32)
        col = tl.load(w_cols_ptr + entry, mask=valid, other=0)
        x = tl.load(x_ptr + col, mask=valid, other=0.0).to(tl.float32)
        acc += tl.sum(w * x, axis=1)
    y = acc + tl.load(bias_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    if RELU:
        y = tl.maximum(y, 0.0)
    tl.store(out_ptr + offs_r, y, mask=mask_r)


@dataclass(frozen=True)
class RowsConfig:
    """A launch of the row kernel: `block_r` rows per program, `block_k` stored entries per row and step."""

    block_r: int = 4
    block_k: int = 128
    num_warps: int = 4


DEFAULT_ROWS_CONFIG = RowsConfig()
ROWS_CONFIGS = (DEFAULT_ROWS_CONFIG, RowsConfig(1, 256, 2), RowsConfig(2, 256, 4), RowsConfig(8, 128, 8))
"""What `SparseNetwork.tune` times per layer: few rows per program give more programs (parallel loads) for
layers of few rows; more rows per program fewer, longer ones."""


def linear_rows(
    x: torch.Tensor,
    weights: CsrLinearWeights,
    bias: torch.Tensor,
    *,
    relu: bool,
    config: RowsConfig = DEFAULT_ROWS_CONFIG,
) -> torch.Tensor:
    """`relu?(bias + W @ x)` for a dense `[in_features]` vector `x` in the weights' dtype (the output's too), row by
    row over the weight's CSR copy: each program reduces `config.block_r` rows, gathering `x` at their stored
    columns, `config.block_k` entries at a time (no atomics; every stored weight is read once, zero activations
    included). Returns a new `[out_features]` tensor."""
    if tuple(x.shape) != (weights.in_features,) or x.dtype != weights.values.dtype or not x.is_contiguous():
        raise ValueError(
            f"x must be a contiguous {weights.values.dtype} [{weights.in_features}] vector, got {x.dtype} "
            f"{tuple(x.shape)}"
        )
    if tuple(bias.shape) != (weights.out_features,) or not bias.is_contiguous():
        raise ValueError(f"bias must be a contiguous [{weights.out_features}] tensor, got {tuple(bias.shape)}")
    out = torch.empty(weights.out_features, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(weights.out_features, config.block_r),)
    _csr_gemv_kernel[grid](
        out,
        x,
        bias,
        weights.values,
        weights.cols,
        weights.row_ptr,
        weights.out_features,
        RELU=relu,
        BLOCK_R=config.block_r,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
    )
    return out
