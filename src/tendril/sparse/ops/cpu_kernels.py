"""Compiled (numba) loops of the CPU backend; the operators in `ops/*/cpu.py` prepare their operands.

Why compiled: the sparse dataflows are loops over irregular lists, which torch ops can only express
as `index_add_` scatters or sparse-CSR products, much slower than these loops (the `sparse-cpu`
benchmark compares them). Every parallel loop (`prange`) runs over disjoint outputs, so
there are no atomics; the thread count is numba's (`cpu_threads.kernel_threads`). numba splits a
`prange` into one contiguous chunk per thread, so each loop here runs over many small work units of
about equal cost (never over a dimension as small as a layer's input channels).

- `compress_planes`: one branch-free pass per virtual channel over the input pixels of its phase
  plane (padding is skipped, never materialized), writing values, positions, row pointers and the
  true count (the `CompressedActivations` layout); every pixel is written to the next free slot,
  which only a nonzero claims.
- `fill_planes`: a dense `[C, H, W]` activation straight into the direct dataflow's zero-padded
  phase planes (row width `row`), counting each virtual channel's nonzeros on the way; parallel over
  virtual channels. It returns the cartesian dataflow's products for these counts (`Σ counts × weights per
  channel`, what the cost model compares), as do `count_channels` and `sum_band_counts`, so that choosing the
  dataflow takes no other pass.
- `scatter_planes`: compressed activations into the same planes (the inverse of `compress_planes`).
- `conv_cartesian`: SCNN's dataflow. For each block of output channels (its halo accumulators stay in
  the L2 cache) and each virtual input channel, every nonzero weight meets every stored activation and
  the product is added at `weight base + activation address`: work = nonzero weights × nonzero
  activations, but each product is a scalar read-modify-write at a scattered address.
- `conv_direct`: the output-stationary sparse-weight dataflow. A work unit is (a band of output rows,
  a block of output channels, `k_starts[b]` to `k_starts[b + 1]`). For each output channel of the block, its
  accumulators for the band (≤ `band_rows × row` floats, in the L1 cache) start at zero and every nonzero weight adds
  `w × (a contiguous slice of its channel's plane)`, eight weights per pass (one load and store of the
  accumulators per eight FMAs), then one pass of four: each channel's weights are padded with zeros to a multiple of
  four, so no channel needs one-weight passes, and one with few weights (a 1×1 layer of few input channels has a
  handful) pays for at most three zero weights, not seven. The pass is vectorized over the band: its indices
  are unsigned (`_at`), and its length is rounded up to a multiple of `vector`, so no scalar remainder loop runs:
  the extra accumulators read on past the band (the next rows, or the next channels' planes) and are never written
  out. Only a channel whose reads would run past the end of the planes (`reach[k]`, its weights' largest base,
  says) takes the band's exact length. The band's input
  rows of every channel (reused by all output channels of the unit) stay in the L2 cache. Bias, the
  residual and ReLU are applied when the band is written out, cropped to the output width, into a `[K, ·]` output
  whose channel rows hold each row of the output grid at `out_at + y × out_row` (a contiguous `[K, OH, OW]` output:
  0 and OW; the next layer's zero-padded phase planes: their interior, `prepared.py`), and the nonzeros
  written are counted on the way: with `band_counts` (`[bands, K]`, or `[0, 0]`: not kept) each unit stores its
  band's count per output channel, so that a next layer reading this output directly needs no counting pass.
  Work = nonzero weights × output pixels.
- `count_channels`: the nonzeros of each channel of a dense `[C, H, W]` input, for the layers whose
  direct dataflow reads the input itself (unpadded 1×1 stride-1 layers need no planes); parallel over
  channels, each row counted in float32 (vectorized, exact below 2^24 per row).
- `sum_band_counts`: the same counts from the `band_counts` of the direct kernel that wrote the input (serial:
  a sum over a few bands per channel, no parallel region).
- `bias_residual_relu`: `out[k] = [relu](out[k] + bias[k] + residual[k])` in place over a `[K, N]` product
  (what follows a library product), one pass; parallel over rows.
- `mean_planes`: the mean of each `[H·W]` plane (global average pooling), parallel over planes.
- `max_pool_planes`: max pooling of `[P, H, W]` planes, parallel over planes, separably: per output row, the
  maxima over its window rows (one contiguous, vectorizable pass per row into a `-inf`-padded buffer), then over
  each window's columns; NaNs propagate as in torch's `max_pool2d`.
- `linear_dense_input`: the sparse FC layer. Each nonzero input feature meets the nonzero column of
  its feature (CSC); input features are split into parts of about equal weight nonzeros, one
  accumulator row each; a second parallel pass sums the parts with the bias and applies ReLU. The scatter
  indexes with unsigned integers (`_at`; the weights' row indices are checked non-negative when they are
  built), which spares every product numba's negative-index wraparound.
"""

from __future__ import annotations

import numpy as np
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


@njit(parallel=True, cache=True, fastmath=True)
def fill_planes(x, stride_h, stride_w, pad_h, pad_w, planes, row, plane_rows, counts, weights_per_channel):
    height, width = x.shape[1], x.shape[2]
    phases = stride_h * stride_w
    for v in prange(planes.shape[0]):
        c, py, px = v // phases, (v % phases) // stride_w, v % stride_w
        first_ix = min(row, max(0, -((px - pad_w) // stride_w)))
        end_ix = max(first_ix, min(row, (width - 1 + pad_w - px) // stride_w + 1))
        start = first_ix * stride_w + px - pad_w
        plane = planes[v]
        n = 0
        for iy in range(plane_rows):
            y = iy * stride_h + py - pad_h
            at = iy * row
            if y < 0 or y >= height:
                plane[at : at + row] = 0
                continue
            for i in range(first_ix):  # the padding's columns: loops, as a slice costs more than these few stores
                plane[_at(at, i)] = 0
            for i in range(end_ix, row):
                plane[_at(at, i)] = 0
            n += _copy_row(x[c, y], start, stride_w, plane, at + first_ix, end_ix - first_ix)
        plane[plane_rows * row :] = 0
        counts[v] = n
    return _products(counts, weights_per_channel)


@njit(inline="always", fastmath=True)
def _copy_row(source, start, step, target, at, count):
    """`target[at : at + count] = source[start : start + count × step : step]` by unsigned indices (a strided slice
    would be copied element by element with index checks; at step 1 the loop vectorizes as a slice copy does);
    returns the nonzeros copied (counted in float32: vectorized, exact below 2^24)."""
    n = np.float32(0)
    for i in range(count):
        value = source[_at(start, i * step)]
        target[_at(at, i)] = value
        n += np.float32(value != 0)
    return np.int64(n)


@njit(parallel=True, cache=True)
def scatter_planes(planes, values, positions, counts, plane_w, row):
    for v in prange(planes.shape[0]):
        planes[v, :] = 0
        for j in range(counts[v]):
            p = positions[v, j]
            planes[v, (p // plane_w) * row + p % plane_w] = values[v, j]


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
def conv_direct(
    out, residual, planes, band_counts, out_at, out_row, out_h, out_w, bias, relu, values, base, k_ptr, reach, row,
    band_rows, k_starts, vector,
):
    bands = (out_h + band_rows - 1) // band_rows
    k_blocks = k_starts.shape[0] - 1
    has_residual = residual.shape[0] > 0
    flat_residual = residual.reshape(-1)
    counted = band_counts.shape[0] > 0
    for unit in prange(bands * k_blocks):
        band, kb = unit // k_blocks, unit % k_blocks
        y0 = band * band_rows
        rows = min(band_rows, out_h - y0)
        t0 = y0 * row
        rounded = -(-rows * row // vector) * vector
        acc = np.empty(-(-band_rows * row // vector) * vector, dtype=np.float32)
        for k in range(k_starts[kb], k_starts[kb + 1]):
            m = rounded if reach[k] + t0 + rounded <= planes.shape[0] else rows * row
            acc[:m] = 0
            i, last = k_ptr[k], k_ptr[k + 1]
            while i + 8 <= last:
                b0, b1, b2, b3 = _at(base[i], t0), _at(base[i + 1], t0), _at(base[i + 2], t0), _at(base[i + 3], t0)
                b4, b5, b6, b7 = _at(base[i + 4], t0), _at(base[i + 5], t0), _at(base[i + 6], t0), _at(base[i + 7], t0)
                w0, w1, w2, w3 = values[i], values[i + 1], values[i + 2], values[i + 3]
                w4, w5, w6, w7 = values[i + 4], values[i + 5], values[i + 6], values[i + 7]
                for q in range(np.uint64(m)):
                    low = (w0 * planes[b0 + q] + w1 * planes[b1 + q]) + (w2 * planes[b2 + q] + w3 * planes[b3 + q])
                    high = (w4 * planes[b4 + q] + w5 * planes[b5 + q]) + (w6 * planes[b6 + q] + w7 * planes[b7 + q])
                    acc[q] += low + high
                i += 8
            if i < last:  # the last four (each channel's list is padded to a multiple of four)
                b0, b1, b2, b3 = _at(base[i], t0), _at(base[i + 1], t0), _at(base[i + 2], t0), _at(base[i + 3], t0)
                w0, w1, w2, w3 = values[i], values[i + 1], values[i + 2], values[i + 3]
                for q in range(np.uint64(m)):
                    acc[q] += (w0 * planes[b0 + q] + w1 * planes[b1 + q]) + (w2 * planes[b2 + q] + w3 * planes[b3 + q])
            written = write_band(
                out[k], out_at, out_row, out_w, acc, bias[k], flat_residual, k * out_h * out_w, has_residual, relu, y0,
                rows, row,
            )  # fmt: skip
            if counted:
                band_counts[band, k] = written


@njit(parallel=True, cache=True, fastmath=True)
def linear_dense_input(out, bias, relu, x, values, rows, col_ptr, bounds, parts, counts):
    for part in prange(parts.shape[0]):
        acc = parts[part]
        acc[:] = 0
        for f in range(bounds[part], bounds[part + 1]):
            a = x[f]
            if a != 0:
                for e in range(_at(col_ptr[f], 0), _at(col_ptr[f + 1], 0)):
                    acc[_at(rows[e], 0)] += values[e] * a
    n_parts, features = parts.shape
    chunk = 256
    for c in prange((features + chunk - 1) // chunk):
        for o in range(c * chunk, min(features, (c + 1) * chunk)):
            value = bias[o]
            for part in range(n_parts):
                value += parts[part, o]
            if relu and value < 0:
                value = 0
            out[o] = value
    counts[0] = np.count_nonzero(x)


@njit(parallel=True, cache=True, fastmath=True)
def count_channels(x, counts, weights_per_channel):
    for c in prange(x.shape[0]):
        n = np.int64(0)
        for y in range(x.shape[1]):
            row = x[c, y]
            in_row = np.float32(0)
            for i in range(row.shape[0]):
                in_row += np.float32(row[i] != 0)
            n += np.int64(in_row)
        counts[c] = n
    return _products(counts, weights_per_channel)


@njit(cache=True)
def sum_band_counts(band_counts, counts, weights_per_channel):
    channels = counts.shape[0]
    for c in range(channels):
        counts[c] = 0
    for band in range(band_counts.shape[0]):
        for c in range(channels):
            counts[c] += band_counts[band, c]
    return _products(counts, weights_per_channel)


@njit(inline="always")
def _products(counts, weights_per_channel):
    """The cartesian dataflow's products for activations with these counts per virtual channel."""
    products = np.int64(0)
    for v in range(counts.shape[0]):
        products += np.int64(counts[v]) * weights_per_channel[v]
    return products


@njit(parallel=True, cache=True, fastmath=True)
def bias_residual_relu(out, bias, residual, relu):
    has_residual = residual.shape[0] > 0
    width = np.uint64(out.shape[1])
    for k in prange(out.shape[0]):
        row = out[k]
        value_bias = bias[k]
        for i in range(width):
            value = row[i] + value_bias
            if has_residual:
                value += residual[k, i]
            if relu:
                value = max(value, np.float32(0))
            row[i] = value


@njit(inline="always", fastmath=True)
def write_band(out, out_at, out_row, out_w, acc, bias, residual, residual_at, has_residual, relu, y0, rows, row):
    """One output channel's band, from accumulators of row width `row`, cropped, with bias, the residual (flat, the
    channel's grid from `residual_at`) and ReLU, into `out` (the channel's flat output: output row `y` starts at
    `out_at + y × out_row`); flat unsigned indices and loop-invariant branches, so the row loops vectorize. Returns
    the nonzeros written (counted in float32 per row: vectorized, exact below 2^24)."""
    width = np.uint64(out_w)
    written = np.int64(0)
    for yy in range(np.uint64(rows)):
        y = y0 + yy
        at = _at(out_at, y * out_row)
        resid = _at(residual_at, y * width)
        band_at = yy * np.uint64(row)
        in_row = np.float32(0)
        for xx in range(width):
            value = acc[band_at + xx] + bias
            if has_residual:
                value += residual[resid + xx]
            if relu:
                value = max(value, np.float32(0))
            out[at + xx] = value
            in_row += np.float32(value != 0)
        written += np.int64(in_row)
    return written


@njit(inline="always")
def _at(base, offset):
    """An unsigned flat index: numba indexes with it without a negative-index check, so loops vectorize."""
    return np.uint64(base + offset)


@njit(parallel=True, cache=True, fastmath=True)
def mean_planes(x, out):
    size = x.shape[1]
    for p in prange(x.shape[0]):
        total = np.float32(0)
        for i in range(size):
            total += x[p, i]
        out[p] = total / np.float32(size)


@njit(parallel=True, cache=True)
def max_pool_planes(x, out, kh, kw, sh, sw, ph, pw):
    height, width = x.shape[1], x.shape[2]
    oh, ow = out.shape[1], out.shape[2]
    n_in, n_out = np.uint64(width), np.uint64(ow)
    scratch = np.full((x.shape[0], width + 2 * pw), -np.inf, dtype=x.dtype)  # one output row's window-row maxima
    for p in prange(x.shape[0]):
        nan = _has_nan(x[p])  # only then the exact NaN test runs; the plain maximum vectorizes
        rows = scratch[p]  # padded with -inf on both sides
        inner = rows[pw : pw + width]
        for oy in range(oh):
            first = max(0, oy * sh - ph)  # the window's rows inside the plane (floor mode: at least one)
            stop = min(height, oy * sh - ph + kh)
            inner[:] = x[p, first]
            for iy in range(first + 1, stop):
                row = x[p, iy]
                if nan:
                    for ix in range(n_in):
                        inner[ix] = _nan_max(row[ix], inner[ix])
                else:
                    for ix in range(n_in):
                        value, held = row[ix], inner[ix]
                        inner[ix] = value if value > held else held
            out_row = out[p, oy]
            if sw == 2 and not nan:  # the common stride, a constant: the loops vectorize as interleaved loads
                for ox in range(n_out):
                    out_row[ox] = rows[ox * np.uint64(2)]
                for j in range(1, kw):
                    window = rows[j:]
                    for ox in range(n_out):
                        value, held = window[ox * np.uint64(2)], out_row[ox]
                        out_row[ox] = value if value > held else held
                continue
            for ox in range(n_out):
                out_row[ox] = rows[ox * np.uint64(sw)]
            for j in range(1, kw):
                window = rows[j:]
                for ox in range(n_out):
                    out_row[ox] = _nan_max(window[ox * np.uint64(sw)], out_row[ox])


@njit(inline="always")
def _has_nan(plane):
    """Whether a `[H, W]` plane holds a NaN (one vectorized pass, no temporary array)."""
    found = False
    for row in plane:
        for i in range(np.uint64(row.shape[0])):
            found |= row[i] != row[i]
    return found


@njit(inline="always")
def _nan_max(value, held):
    """The larger of the two, NaN if either is NaN (torch's max_pool2d)."""
    return value if value > held or value != value else held
