"""Sparse fully-connected layer on the CPU: the same column-gather Cartesian product, vectorized.

The columns of the stored activations are expanded into one list of weight entries (segment
arithmetic with `repeat_interleave`), multiplied by their activation and scattered with
`index_add_`. Multi-threaded: the activations are split into ranges of about equal entry count, one
per worker, each with its own accumulator.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from tendril.sparse.format import CompressedActivations, SparseLinearWeights
from tendril.sparse.ops.cpu_threads import balanced_ranges, single_intraop_thread


def linear(
    acts: CompressedActivations, weights: SparseLinearWeights, init: torch.Tensor, *, threads: int = 1
) -> torch.Tensor:
    """`init + W @ a` (`init` is `[out_features]`, left unchanged)."""
    count = int(acts.stored_counts[0])
    features = acts.positions[0, :count].long()
    a = acts.values[0, :count]
    begin = weights.col_ptr[features].long()
    lengths = weights.col_ptr[features + 1].long() - begin

    def run(first: int, last: int) -> torch.Tensor:
        acc = torch.zeros(weights.out_features)
        seg = lengths[first:last]
        total = int(seg.sum())
        if total == 0:
            return acc
        seg_start = torch.cumsum(seg, 0) - seg
        entry = torch.arange(total) + torch.repeat_interleave(begin[first:last] - seg_start, seg)
        products = weights.values[entry] * torch.repeat_interleave(a[first:last], seg)
        acc.index_add_(0, weights.rows[entry].long(), products)
        return acc

    if threads <= 1:
        acc = run(0, count)
    else:
        with single_intraop_thread(), ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(lambda r: run(*r), balanced_ranges(lengths.tolist(), threads)))
        acc = torch.stack(parts).sum(0)
    return init + acc
