"""Sparse fully-connected layer on the CPU: the column-gather Cartesian product, compiled.

Each nonzero activation meets exactly the nonzero column of its input feature (CSC weights): the
products are added into the output at the column's row indices. The work is
`sum over nonzero activations of their column's nonzeros`, and only those columns are read from
memory (a dense FC layer streams the whole weight matrix). The kernel reads the dense input vector
and skips its zeros itself, so the layer needs no compression pass. Multi-threaded: the input
features are split into ranges of about equal weight nonzeros, each accumulated into its own output
row; a second parallel pass sums the rows with the bias and applies ReLU (SCNN's partial-sum
exchange).

A CPU network's layer runs through its `PreparedLinear`, which works out the operands that do not depend on the
input (numpy views, the split of the features for the thread count, the parts' buffer) once per thread count and
batch size, as `conv/cpu/prepared.py` does for convolutions (and, like it, reuses its output buffer only where the
`RunState` lists the layer in `reused_outputs`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import SparseLinearWeights
from tendril.sparse.ops.cpu_threads import held, kernel_threads, kernels, usable

if TYPE_CHECKING:
    from tendril.sparse.steps import RunState, SparseLinearStep


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


class PreparedLinear:
    """One FC layer's CPU call at one thread count and batch size: `linear_dense_input` per sample, on operands
    worked out once (the module docstring)."""

    def __init__(self, step: SparseLinearStep, state: RunState, batch: int) -> None:
        w = step.weights
        self.step, self.name, self.relu = step, step.name, step.relu
        self.threads, self.used = state.threads, usable(state.threads)
        self.in_shape, self.out_shape = (batch, w.in_features), (batch, w.out_features)
        layout = step.layout
        self.capacity = layout.capacity if layout.capacity < layout.plane_size else None
        bounds = _balanced_bounds(w.col_ptr[1:] - w.col_ptr[:-1], self.used)
        parts = np.empty((bounds.numel() - 1, w.out_features), dtype=np.float32)
        self.operands = (w.values.numpy(), w.rows.numpy(), w.col_ptr.numpy(), bounds.numpy(), parts)
        self.bias = step.bias.contiguous().numpy()
        self.counts = torch.empty(1, dtype=torch.int32)
        self.counts_array = self.counts.numpy()
        self.output = torch.empty(self.out_shape) if step.name in state.reused_outputs else None

    def accepts(self, x: torch.Tensor) -> bool:
        """Whether `x` is an input this call was prepared for (the batch size and shape it expects, fp32)."""
        return x.shape == self.in_shape and x.dtype is torch.float32

    def __call__(self, x: torch.Tensor, state: RunState) -> torch.Tensor:
        """The layer's output for `x` (which `accepts`), on the prepared thread count."""
        if held() == self.used:
            return self._run(x, state)
        with kernel_threads(self.threads):
            return self._run(x, state)

    def _run(self, x: torch.Tensor, state: RunState) -> torch.Tensor:
        y = torch.empty(self.out_shape) if self.output is None else self.output
        outputs, inputs = y.numpy(), (x if x.is_contiguous() else x.contiguous()).numpy()
        for b in range(self.in_shape[0]):
            kernels().linear_dense_input(outputs[b], self.bias, self.relu, inputs[b], *self.operands, self.counts_array)
            state.count_host(self.name, self.counts, self.capacity)
        return y


def _balanced_bounds(entries: torch.Tensor, parts: int) -> torch.Tensor:
    """`parts + 1` ascending cut points splitting the features into ranges of about equal entries."""
    if parts == 1 or entries.numel() == 0:
        return torch.tensor([0, entries.numel()], dtype=torch.int64)
    cumulative = torch.cumsum(entries.long(), 0)
    targets = cumulative[-1] * torch.arange(1, parts, dtype=torch.int64) // parts
    cuts = torch.searchsorted(cumulative, targets, right=True)
    return torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([entries.numel()])])
