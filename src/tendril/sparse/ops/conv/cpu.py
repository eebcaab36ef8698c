"""Sparse×sparse convolution on the CPU: the same Cartesian-product dataflow, vectorized with torch ops.

For each virtual input channel, the outer product of its nonzero weights and nonzero activations is
formed in one go, and the products are scattered with `index_add_` into a dense accumulator that
carries a halo of `r' - 1` rows and `s' - 1` columns on the top-left (SCNN's halo accumulators):
every address `weight part + activation part` lands inside the buffer, so no product needs a bounds
check, and the halo is cropped off at the end. Large channels are processed in chunks of activations
to bound temporary memory.

Multi-threaded: virtual channels are split into contiguous ranges of about equal product count, one
per worker thread, each with its own accumulator (torch ops release the GIL); the accumulators are
summed at the end, as SCNN's processing elements exchange partial sums.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from tendril.sparse.format import CompressedActivations, SparseConvWeights
from tendril.sparse.ops.cpu_threads import balanced_ranges, single_intraop_thread

MAX_PRODUCTS_PER_STEP = 1 << 22


def conv(
    acts: CompressedActivations, weights: SparseConvWeights, init: torch.Tensor, *, threads: int = 1
) -> torch.Tensor:
    """`init + conv(acts, weights)` (`init` is `[K, OH, OW]`, left unchanged)."""
    g = weights.geometry
    kh, kw = g.plane_kernel
    hv, wv = acts.layout.plane_hw
    oh, ow = g.out_hw
    acc_h, acc_w = kh - 1 + max(hv, oh), kw - 1 + max(wv, ow)
    plane = acc_h * acc_w
    taps = weights.taps.long()
    weight_part = (taps >> 16) * plane - ((taps >> 8) & 0xFF) * acc_w - (taps & 0xFF) + (kh - 1) * acc_w + (kw - 1)
    counts = acts.stored_counts.tolist()
    ptr = weights.channel_ptr.tolist()
    work = [counts[v] * (ptr[v + 1] - ptr[v]) for v in range(g.virtual_channels)]

    def run(first: int, last: int) -> torch.Tensor:
        acc = torch.zeros(g.out_channels * plane)
        for v in range(first, last):
            if work[v] == 0:
                continue
            w = weights.values[ptr[v] : ptr[v + 1]]
            wp = weight_part[ptr[v] : ptr[v + 1]]
            flat = acts.positions[v, : counts[v]].long()
            act_part = (flat // wv) * acc_w + flat % wv
            a = acts.values[v, : counts[v]]
            step = max(1, MAX_PRODUCTS_PER_STEP // w.numel())
            for start in range(0, counts[v], step):
                address = wp[:, None] + act_part[None, start : start + step]
                acc.index_add_(0, address.flatten(), (w[:, None] * a[None, start : start + step]).flatten())
        return acc

    if threads <= 1:
        acc = run(0, g.virtual_channels)
    else:
        with single_intraop_thread(), ThreadPoolExecutor(threads) as pool:
            parts = list(pool.map(lambda r: run(*r), balanced_ranges(work, threads)))
        acc = torch.stack(parts).sum(0) if len(parts) > 1 else parts[0]
    acc = acc.view(g.out_channels, acc_h, acc_w)[:, kh - 1 : kh - 1 + oh, kw - 1 : kw - 1 + ow]
    return init + acc
