"""Sparse fully-connected layer on the CPU: the column-gather Cartesian product, compiled.

Each nonzero activation meets exactly the nonzero column of its input feature (CSC weights): the
products are added into the output at the column's row indices. The work is
`sum over nonzero activations of their column's nonzeros`, and only those columns are read from
memory (a dense FC layer streams the whole weight matrix). The kernel reads the dense input vector
and skips its zeros itself, so the layer needs no compression pass. Multi-threaded: the input
features are split into ranges of about equal weight nonzeros, each accumulated into its own output
row; a second parallel pass sums the rows with the bias and applies ReLU (SCNN's partial-sum
exchange).
"""

from __future__ import annotations

import torch

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import SparseLinearWeights
from tendril.sparse.ops.cpu_threads import kernel_threads, kernels


def linear(
    acts: CompressedActivations, weights: SparseLinearWeights, init: torch.Tensor, *, threads: int = 1
) -> torch.Tensor:
    """`init + W @ a` (`init` is `[out_features]`, left unchanged) for compressed activations."""
    count = int(acts.stored_counts[0])
    x = torch.zeros(weights.in_features)
    x[acts.positions[0, :count].long()] = acts.values[0, :count]
    out = torch.empty(weights.out_features)
    linear_dense_input(x, weights, init, out=out, threads=threads)
    return out


def linear_dense_input(
    x: torch.Tensor,
    weights: SparseLinearWeights,
    bias: torch.Tensor,
    *,
    out: torch.Tensor,
    relu: bool = False,
    threads: int = 1,
) -> torch.Tensor:
    """`out = [relu](bias + W @ x)` for a dense `[in_features]` input; returns its nonzero count (`[1]`).

    The compiled loop indexes without bounds checks, so every operand is checked here (the weights checked
    themselves at construction): fp32 CPU tensors of the layer's shapes."""
    if not isinstance(weights, SparseLinearWeights):
        raise TypeError(f"weights: expected SparseLinearWeights, got {type(weights).__name__}")
    for name, t, features in (
        ("x", x, weights.in_features),
        ("bias", bias, weights.out_features),
        ("out", out, weights.out_features),
    ):
        if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (features,):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}"
            raise ValueError(f"{name}: expected a float32 CPU tensor of shape ({features},), got {got}")
    if not out.is_contiguous():
        raise ValueError(f"out must be a contiguous tensor of shape ({weights.out_features},)")
    counts = torch.empty(1, dtype=torch.int32)
    with kernel_threads(threads) as used:
        bounds = _balanced_bounds(weights.col_ptr[1:] - weights.col_ptr[:-1], used)
        parts = torch.empty(bounds.numel() - 1, weights.out_features)
        kernels().linear_dense_input(
            out.numpy(),
            bias.contiguous().numpy(),
            relu,
            x.contiguous().numpy(),
            weights.values.numpy(),
            weights.rows.numpy(),
            weights.col_ptr.numpy(),
            bounds.numpy(),
            parts.numpy(),
            counts.numpy(),
        )
    return counts


def _balanced_bounds(entries: torch.Tensor, parts: int) -> torch.Tensor:
    """`parts + 1` ascending cut points splitting the features into ranges of about equal entries."""
    if parts == 1 or entries.numel() == 0:
        return torch.tensor([0, entries.numel()], dtype=torch.int64)
    cumulative = torch.cumsum(entries.long(), 0)
    targets = cumulative[-1] * torch.arange(1, parts, dtype=torch.int64) // parts
    cuts = torch.searchsorted(cumulative, targets, right=True)
    return torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([entries.numel()])])
