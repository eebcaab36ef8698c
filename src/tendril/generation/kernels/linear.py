"""Fused norm -> projection -> activation -> residual for a few rows (one-token decode steps), in one kernel.

At batch 1 a decode step's matrix products are matrix-vector products bound by reading the weights;
cuBLAS runs each as its own kernel, with the norm before it and the bias, activation and residual add
after it as more kernels. Here one kernel does all of it: each program owns `BLOCK_N` output columns of
one row, recomputes the norm's statistics from the input row (a few KiB, read from L2 by every program),
streams its weight columns in `[BLOCK_K, BLOCK_N]` tiles, accumulates in float32 and applies bias,
activation and addends before its one store. Rounding to the tensor dtype happens where HF's eager
forward rounds (see `reference.py`), so fp16 results track HF's closely.

A projection may have up to three weight matrices whose outputs are concatenated (Llama's q, k and v):
the programs are split between them by their column blocks. `GATED` computes two matrices per program
and returns `act(first) * second` (Llama's gated MLP). Weights are `[out, in]` views with any strides
(GPT-2's Conv1D weights are read transposed, in place).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from tendril.generation.kernels.layers import ACTIVATIONS, Norm, Projection

_NORMS = {None: 0, "layer": 1, "rms": 2}


@triton.jit
def _fused_linear_kernel(
    x_ptr,
    stride_xm,
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
    NORM: tl.constexpr,
    HAS_NORM_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,
    ACTIVATION: tl.constexpr,
    ADDENDS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    DTYPE = out_ptr.dtype.element_ty
    x_row_ptr = x_ptr + row * stride_xm

    # which weight matrix (segment) this program's columns belong to; GATED reads w0 and w1 together
    blocks0 = (N0 + BLOCK_N - 1) // BLOCK_N
    blocks1 = (N1 + BLOCK_N - 1) // BLOCK_N
    w_ptr, b_ptr, n_size, block, col0 = w0_ptr, b0_ptr, N0, pid, pid * 0
    if not GATED:
        if pid >= blocks0 + blocks1:
            w_ptr, b_ptr, n_size, block, col0 = w2_ptr, b2_ptr, N2, pid - blocks0 - blocks1, N0 + N1
        elif pid >= blocks0:
            w_ptr, b_ptr, n_size, block, col0 = w1_ptr, b1_ptr, N1, pid - blocks0, N0
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] columns within the segment
    n_mask = offs_n < n_size

    mean = 0.0
    rstd = 1.0
    if NORM != 0:
        total = tl.zeros([BLOCK_K], dtype=tl.float32)
        if NORM == 1:
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                total += tl.load(x_row_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            mean = tl.sum(total, axis=0) / K
            total = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            centered = tl.where(offs_k < K, x - mean, 0.0)
            total += centered * centered
        rstd = 1.0 / tl.sqrt(tl.sum(total, axis=0) / K + eps)

    acc = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_K, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = offs_k < K
        x = tl.load(x_row_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        if NORM == 1:  # LayerNorm, output rounded to DTYPE
            x = (x - mean) * rstd * tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            if HAS_NORM_BIAS:
                x += tl.load(norm_b_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            x = x.to(DTYPE).to(tl.float32)
        elif NORM == 2:  # RMSNorm: weight * (x * rstd).to(DTYPE), rounded
            x = (x * rstd).to(DTYPE).to(tl.float32)
            x = (x * tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)).to(DTYPE).to(tl.float32)
        w_offsets = offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
        tile_mask = k_mask[:, None] & n_mask[None, :]
        acc += x[:, None] * tl.load(w_ptr + w_offsets, mask=tile_mask, other=0.0).to(tl.float32)
        if GATED:
            acc_up += x[:, None] * tl.load(w1_ptr + w_offsets, mask=tile_mask, other=0.0).to(tl.float32)

    y = tl.sum(acc, axis=0)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    y = y.to(DTYPE).to(tl.float32)
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
        up = tl.sum(acc_up, axis=0)
        if HAS_BIAS:
            up += tl.load(b1_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = y.to(DTYPE).to(tl.float32) * up.to(DTYPE).to(tl.float32)
    y = y.to(DTYPE).to(tl.float32)
    cols = col0 + offs_n
    if ADDENDS >= 1:  # each sum rounded, as HF's residual adds
        add0 = tl.load(add0_ptr + row * stride_a0m + cols, mask=n_mask, other=0.0).to(tl.float32)
        y = (y + add0).to(DTYPE).to(tl.float32)
    if ADDENDS >= 2:
        add1 = tl.load(add1_ptr + row * stride_a1m + cols, mask=n_mask, other=0.0).to(tl.float32)
        y = (y + add1).to(DTYPE).to(tl.float32)
    tl.store(out_ptr + row * stride_om + cols, y.to(DTYPE), mask=n_mask)


def block_sizes(out_columns: int, in_features: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K): enough programs to spread the weight reads over the GPU (a few per SM of an
    H100/H200-sized part), in tiles of at most 4096 elements."""
    block_n = 16
    while block_n < 128 and triton.cdiv(out_columns, block_n * 2) >= 256:
        block_n *= 2
    block_k = max(16, min(triton.next_power_of_2(in_features), 4096 // block_n, 256))
    return block_n, block_k


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
    num_warps: int = 4,
) -> torch.Tensor:
    """The Triton kernel of `reference.fused_linear` (same arguments); x is [rows, in] with unit column stride.
    `block_n`, `block_k` and `num_warps` override the launch configuration (`block_sizes` by default)."""
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
        out = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    weights = list(projection.weights) + [projection.weights[0]] * (3 - len(sizes))
    biases = [b if b is not None else weights[0] for b in projection.biases]
    biases += [biases[0]] * (3 - len(biases))
    padded = list(sizes) + [0] * (3 - len(sizes))
    columns = sizes[0] if gated else max(sizes)
    default_n, default_k = block_sizes(columns, in_features)
    block_n, block_k = block_n or default_n, block_k or default_k
    blocks = triton.cdiv(sizes[0], block_n) if gated else sum(triton.cdiv(n, block_n) for n in sizes)
    norm_w = norm.weight if norm is not None else x
    norm_b = norm.bias if norm is not None and norm.bias is not None else norm_w
    add0 = addends[0] if addends else out
    add1 = addends[1] if len(addends) > 1 else out
    _fused_linear_kernel[(blocks, rows)](
        x, x.stride(0), in_features,
        norm_w, norm_b, norm.eps if norm is not None else 0.0,
        weights[0], weights[1], weights[2], weights[0].stride(0), weights[0].stride(1),
        biases[0], biases[1], biases[2],
        padded[0], 0 if gated else padded[1], padded[2],
        add0, add0.stride(0), add1, add1.stride(0),
        out, out.stride(0),
        NORM=_NORMS[norm.kind if norm is not None else None],
        HAS_NORM_BIAS=norm is not None and norm.bias is not None,
        HAS_BIAS=projection.biases[0] is not None,
        GATED=gated,
        ACTIVATION=ACTIVATIONS[activation],
        ADDENDS=len(addends),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out
