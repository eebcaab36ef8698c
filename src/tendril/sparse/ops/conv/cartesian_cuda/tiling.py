"""The tiling of the shared-memory SCNN convolution (`kernel.py`), shared with its CPU emulation.

A thread block owns an output tile of `tile_h` full-width rows × `k_block` output channels, whose
accumulators live in shared memory (at most `ACC_CAPACITY` floats) and start as the init (bias +
residual). For every virtual input channel it takes the band of plane rows that can reach the tile
(`tile_h + kernel_h - 1` rows: the tile plus its halo, one contiguous slice thanks to `row_ptr`) and
the channel's weights whose output channel is in the block. Weights are re-sorted per plan by
(channel, output-channel block, kernel row r', k, s'), with a pointer at the start of every
(channel, block, r'), so an activation in tile row `ty` walks only the kernel rows that land in the
tile (`ty - tile_h < r' <= ty`): no product is computed for a neighbouring tile (no halo waste), and
full-width tiles need no column halo. `plan` picks the widest output-channel block that still
leaves `target_blocks` thread blocks, then the tallest tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tendril.sparse.format import ConvGeometry, SparseConvWeights

ACC_CAPACITY = 11264
"""Shared-memory accumulators per thread block (44 KiB of fp32; with 4 KiB of staged channel slices
this is the 48 KiB static shared-memory limit)."""
THREADS = 256


@dataclass(frozen=True)
class TilePlan:
    tile_h: int
    k_block: int
    act_lanes: int
    """Lanes of a warp along a band's activations; the other `32 // act_lanes` split its weights."""

    def grid(self, geometry: ConvGeometry) -> tuple[int, int]:
        return -(-geometry.out_hw[0] // self.tile_h), -(-geometry.out_channels // self.k_block)


def plan(geometry: ConvGeometry, target_blocks: int = 132) -> TilePlan:
    """Widest output-channel block, then tallest tile, that still gives `target_blocks` thread blocks."""
    (oh, ow), k = geometry.out_hw, geometry.out_channels
    best: tuple[tuple[bool, int, int], int, int] | None = None
    for k_block in (64, 32, 16, 8, 4, 2, 1):
        k_block = min(k_block, k)
        rows_max = min(oh, ACC_CAPACITY // (k_block * ow))
        if rows_max < 1:
            continue
        k_blocks = -(-k // k_block)
        tile_h = max(1, min(rows_max, (oh * k_blocks) // target_blocks))
        blocks = -(-oh // tile_h) * k_blocks
        score = (blocks >= target_blocks, k_block, tile_h)
        if best is None or score > best[0]:
            best = (score, tile_h, k_block)
    if best is None:
        raise ValueError(f"output rows of width {ow} do not fit {ACC_CAPACITY} shared-memory accumulators")
    _, tile_h, k_block = best
    band = (tile_h + geometry.plane_kernel[0] - 1) * geometry.plane_hw[1]
    act_lanes = 1
    while act_lanes < 32 and act_lanes * 2 <= band // 2:
        act_lanes *= 2
    return TilePlan(tile_h, k_block, act_lanes)


@dataclass(frozen=True)
class TiledWeights:
    """A layer's nonzero weights in the tile order, with `row_ptr[v, kb * kernel_h + r']` pointers."""

    plan: TilePlan
    kernel_h: int
    values: torch.Tensor
    taps: torch.Tensor
    row_ptr: torch.Tensor
    """`[Cv, n_blocks * kernel_h + 1]` int32: start of channel v's weights of block kb and kernel row r'."""

    @property
    def n_blocks(self) -> int:
        return (self.row_ptr.shape[1] - 1) // self.kernel_h

    @classmethod
    def prepare(cls, weights: SparseConvWeights, tile_plan: TilePlan) -> TiledWeights:
        g = weights.geometry
        kernel_h = g.plane_kernel[0]
        n_blocks = -(-g.out_channels // tile_plan.k_block)
        ptr = weights.channel_ptr.long()
        device = ptr.device
        channel = torch.repeat_interleave(torch.arange(g.virtual_channels, device=device), ptr[1:] - ptr[:-1])
        taps = weights.taps.long()
        segment = (taps >> 16) // tile_plan.k_block * kernel_h + ((taps >> 8) & 0xFF)
        segments = n_blocks * kernel_h
        order = torch.argsort((channel * segments + segment) * (1 << 31) + taps)
        counts = torch.bincount(channel * segments + segment, minlength=g.virtual_channels * segments)
        starts = torch.cumsum(counts, 0) - counts
        row_ptr = torch.empty(g.virtual_channels, segments + 1, dtype=torch.int64, device=device)
        row_ptr[:, :segments] = starts.view(g.virtual_channels, segments)
        row_ptr[:, segments] = ptr[1:]
        return cls(
            tile_plan,
            kernel_h,
            weights.values[order].contiguous(),
            weights.taps[order].contiguous(),
            row_ptr.to(torch.int32),
        )
