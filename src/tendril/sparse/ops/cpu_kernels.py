"""Compiled (numba) loops of the CPU backend; the operators in `ops/*/cpu.py` prepare their operands.

Why compiled: the sparse dataflows are loops over irregular lists, which torch ops can only express
as `index_add_` scatters or sparse-CSR products, 5-40× slower than these loops on one VGG-16 layer
(benchmarks/results/sparse-cpu.md). Every kernel is parallel over disjoint outputs (`prange`), so
there are no atomics and no partial sums to merge; the thread count is numba's (`cpu_threads.kernel_threads`).

- `compress_planes`: one branch-free pass per virtual channel over the input pixels of its phase
  plane (padding is skipped, never materialized), writing values, positions, row pointers and the
  true count (the `CompressedActivations` layout); every pixel is written to the next free slot,
  which only a nonzero claims.
- `scatter_planes`: the inverse into zero-padded planes of row width `row`.
- `conv_cartesian`: SCNN's dataflow. For each block of output channels (its halo accumulators stay in
  the L2 cache) and each virtual input channel, every nonzero weight meets every stored activation and
  the product is added at `weight base + activation address`: work = nonzero weights × nonzero
  activations, but each product is a scalar read-modify-write at a scattered address.
- `conv_direct`: the output-stationary sparse-weight dataflow. For each output channel and tile of
  output pixels, every nonzero weight adds `w × (a contiguous slice of its channel's plane)`, the
  slice starting at the weight's precomputed `base` in the flat planes: a vectorized FMA stream,
  eight weights per pass over the tile (one load and store of the accumulators per eight FMAs).
  Work = nonzero weights × output pixels.
- `linear_columns`: the sparse FC layer: each stored activation meets the nonzero column of its input
  feature (CSC), products added into the output; the activations are split into parts, one
  accumulator each, summed by the caller.
"""

from __future__ import annotations

from numba import njit, prange


@njit(parallel=True, cache=True)
def compress_planes(
    x, stride_h, stride_w, pad_h, pad_w, plane_h, plane_w, capacity, values, positions, row_ptr, counts
):
    channels, height, width = x.shape
    phases = stride_h * stride_w
    for v in prange(channels * phases):
        c, py, px = v // phases, (v % phases) // stride_w, v % stride_w
        first_ix = max(0, -((px - pad_w) // stride_w))
        end_ix = min(plane_w, (width - 1 + pad_w - px) // stride_w + 1)
        n = 0
        row_ptr[v, 0] = 0
        for iy in range(plane_h):
            y = iy * stride_h + py - pad_h
            if 0 <= y < height:
                for ix in range(first_ix, end_ix):
                    value = x[c, y, ix * stride_w + px - pad_w]
                    if n < capacity:
                        values[v, n] = value
                        positions[v, n] = iy * plane_w + ix
                    n += value != 0
            row_ptr[v, iy + 1] = n
        counts[v] = n


@njit(parallel=True, cache=True)
def scatter_planes(out, values, positions, counts, plane_w, row):
    for v in prange(out.shape[0]):
        for j in range(counts[v]):
            p = positions[v, j]
            out[v, (p // plane_w) * row + p % plane_w] = values[v, j]


@njit(parallel=True, cache=True)
def conv_cartesian(acc, values, base, block_ptr, act_values, act_address, counts):
    channels = counts.shape[0]
    for block in prange(acc.shape[0]):
        out = acc[block]
        for v in range(channels):
            n = counts[v]
            for i in range(block_ptr[block, v], block_ptr[block, v + 1]):
                w = values[i]
                b = base[i]
                for j in range(n):
                    out[b + act_address[v, j]] += w * act_values[v, j]


@njit(parallel=True, cache=True, fastmath=True)
def conv_direct(out, values, base, k_ptr, planes, tile):
    pixels = out.shape[1]
    for k in prange(out.shape[0]):
        row = out[k]
        first, last = k_ptr[k], k_ptr[k + 1]
        for t0 in range(0, pixels, tile):
            m = min(pixels - t0, tile)
            acc = row[t0 : t0 + m]
            i = first
            while i + 8 <= last:
                a0 = planes[base[i] + t0 : base[i] + t0 + m]
                a1 = planes[base[i + 1] + t0 : base[i + 1] + t0 + m]
                a2 = planes[base[i + 2] + t0 : base[i + 2] + t0 + m]
                a3 = planes[base[i + 3] + t0 : base[i + 3] + t0 + m]
                a4 = planes[base[i + 4] + t0 : base[i + 4] + t0 + m]
                a5 = planes[base[i + 5] + t0 : base[i + 5] + t0 + m]
                a6 = planes[base[i + 6] + t0 : base[i + 6] + t0 + m]
                a7 = planes[base[i + 7] + t0 : base[i + 7] + t0 + m]
                w0, w1, w2, w3 = values[i], values[i + 1], values[i + 2], values[i + 3]
                w4, w5, w6, w7 = values[i + 4], values[i + 5], values[i + 6], values[i + 7]
                for q in range(m):
                    acc[q] += (w0 * a0[q] + w1 * a1[q] + w2 * a2[q] + w3 * a3[q]) + (
                        w4 * a4[q] + w5 * a5[q] + w6 * a6[q] + w7 * a7[q]
                    )
                i += 8
            while i < last:
                a0 = planes[base[i] + t0 : base[i] + t0 + m]
                w0 = values[i]
                for q in range(m):
                    acc[q] += w0 * a0[q]
                i += 1


@njit(parallel=True, cache=True)
def linear_columns(parts, values, rows, col_ptr, features, act_values, bounds):
    for part in prange(parts.shape[0]):
        acc = parts[part]
        for j in range(bounds[part], bounds[part + 1]):
            f = features[j]
            a = act_values[j]
            for e in range(col_ptr[f], col_ptr[f + 1]):
                acc[rows[e]] += values[e] * a
