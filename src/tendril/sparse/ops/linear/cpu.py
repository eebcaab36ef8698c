"""Sparse fully-connected layer on the CPU: the column-gather Cartesian product, compiled.

Each stored activation meets exactly the nonzero column of its input feature (CSC weights): the
products are added into the output at the column's row indices. The work is
`sum over nonzero activations of their column's nonzeros`, and only those columns are read from
memory (a dense FC layer streams the whole weight matrix). Multi-threaded: the activations are split
into ranges of about equal entry count, each accumulated into its own output row; the rows are
summed at the end (SCNN's partial-sum exchange).
"""

from __future__ import annotations

import torch

from tendril.sparse.format import CompressedActivations, SparseLinearWeights
from tendril.sparse.ops.cpu_threads import kernel_threads, kernels


def linear(
    acts: CompressedActivations, weights: SparseLinearWeights, init: torch.Tensor, *, threads: int = 1
) -> torch.Tensor:
    """`init + W @ a` (`init` is `[out_features]`, left unchanged)."""
    count = int(acts.stored_counts[0])
    features = acts.positions[0, :count].contiguous()
    entries = weights.col_ptr[features.long() + 1] - weights.col_ptr[features.long()]
    with kernel_threads(threads) as used:
        bounds = _balanced_bounds(entries, used)
        parts = torch.zeros(bounds.numel() - 1, weights.out_features)
        kernels().linear_columns(
            parts.numpy(),
            weights.values.numpy(),
            weights.rows.numpy(),
            weights.col_ptr.numpy(),
            features.numpy(),
            acts.values[0, :count].contiguous().numpy(),
            bounds.numpy(),
        )
    return init + (parts[0] if parts.shape[0] == 1 else parts.sum(0))


def _balanced_bounds(entries: torch.Tensor, parts: int) -> torch.Tensor:
    """`parts + 1` ascending cut points splitting the activations into ranges of about equal entries."""
    if parts == 1 or entries.numel() == 0:
        return torch.tensor([0, entries.numel()], dtype=torch.int64)
    cumulative = torch.cumsum(entries.long(), 0)
    targets = cumulative[-1] * torch.arange(1, parts, dtype=torch.int64) // parts
    cuts = torch.searchsorted(cumulative, targets, right=True)
    return torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([entries.numel()])])
