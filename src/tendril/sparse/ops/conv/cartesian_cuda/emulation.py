"""The CUDA kernel's algorithm (`kernel.py`) step for step on the CPU, so CI can check it without a GPU.

Same tiles (`tiling.plan`), same staged slices (a channel's weight slice from `block_ptr`, its band
of activation rows from `row_ptr`, both clamped to the capacity), same skipping of products that
land outside the tile, same tile accumulator started from the init and the same fused ReLU on the
way out. Only the order of the additions inside a tile differs (the GPU's atomics have no order).
Slow by design (Python loops over tiles and channels): use it on small shapes.
"""

from __future__ import annotations

import torch

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import SparseConvWeights
from tendril.sparse.ops.conv.cartesian_cuda.tiling import ACC_CAPACITY, TiledWeights


def conv(
    acts: CompressedActivations,
    weights: SparseConvWeights,
    tiled: TiledWeights,
    init: torch.Tensor,
    *,
    relu: bool = False,
) -> torch.Tensor:
    g = weights.geometry
    tiles = tiled.plan
    (oh, ow), (plane_h, plane_w) = g.out_hw, acts.layout.plane_hw
    capacity, kernel_h = acts.layout.capacity, tiled.kernel_h
    assert tiles.k_block * tiles.tile_h * ow <= ACC_CAPACITY
    out = init.clone()
    taps = tiled.taps.long()
    grid_rows, grid_k = tiles.grid(g)
    for row_tile in range(grid_rows):
        oy0 = row_tile * tiles.tile_h
        rows = min(tiles.tile_h, oh - oy0)
        band = (oy0, min(plane_h, oy0 + rows + kernel_h - 1))
        for kb in range(grid_k):
            k0 = kb * tiles.k_block
            k_count = min(tiles.k_block, g.out_channels - k0)
            acc = out[k0 : k0 + k_count, oy0 : oy0 + rows].clone().flatten()
            for v in range(g.virtual_channels):
                ptr = tiled.row_ptr[v, kb * kernel_h : (kb + 1) * kernel_h + 1].long()
                a_begin = min(int(acts.row_ptr[v, band[0]]), capacity)
                a_end = min(int(acts.row_ptr[v, band[1]]), capacity)
                if ptr[0] == ptr[-1] or a_begin == a_end:
                    continue
                for j in range(a_begin, a_end):
                    flat = int(acts.positions[v, j])
                    ty, ix = flat // plane_w - oy0, flat % plane_w
                    r_lo, r_hi = max(0, ty - rows + 1), min(kernel_h - 1, ty)
                    if r_lo > r_hi:
                        continue
                    w_begin, w_end = int(ptr[r_lo]), int(ptr[r_hi + 1])
                    tap = taps[w_begin:w_end]
                    oy = ty - ((tap >> 8) & 0xFF)
                    ox = ix - (tap & 0xFF)
                    inside = (ox >= 0) & (ox < ow)
                    assert bool(((oy >= 0) & (oy < rows)).all()), "row pointers selected a weight outside the tile"
                    address = ((tap >> 16) - k0) * (rows * ow) + oy * ow + ox
                    products = tiled.values[w_begin:w_end] * acts.values[v, j]
                    acc.index_add_(0, address[inside], products[inside])
            tile = acc.view(k_count, rows, ow)
            out[k0 : k0 + k_count, oy0 : oy0 + rows] = tile.relu() if relu else tile
    return out
