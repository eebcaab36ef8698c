"""The ELL layout the `"ell"` kernel reads, packed once per layer and tile config from the compressed weights.

Output channels are sorted by nonzero count (most first) and grouped `channels` at a time into *tiles*; a
tile's nonzeros are stored as *chunks* of `[depth, channels]` entries: chunk row `j` of the tile's `i`-th chunk
holds each channel's nonzero number `i * depth + j`. A tile is padded with zero weights to its longest
channel's count rounded up to `depth`, so after sorting the padding is the spread of counts within a tile
plus less than `depth` per channel, and a kernel program walks exactly its tile's chunks: work follows the
nonzeros, and the inner loop holds no mask.

Each entry is a weight (fp32, so half-precision weights are held exactly) and the offset it reads in the
input planes the kernel reads (`planes.py`). A padding entry is weight 0 at offset 0 (a valid address). One spare
chunk of zeros follows the last tile, so the kernel's prefetch of the chunk after a tile's last stays in bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.ops.conv.ell.planes import (
    MAX_PIXELS,
    POINTWISE,
    entry_offsets,
    mode_of,
    plane_hw,
    planes_per_channel,
)
from tendril.sparse.validation import ValueChecks, capturing, check_tensor, segment_of

WARP = 32
"""Lanes of a warp: the longest run of consecutive pixels a load instruction can cover for one nonzero."""


@dataclass(frozen=True)
class EllConfig:
    """One tile shape of the kernel: a program computes `channels` output channels × `pixels` output pixels,
    `depth` nonzeros per channel per loop step, with `warps` warps, over `1 / splits` of its tile's chunks
    (`splits` programs share a tile's work; the last to finish sums their partial sums). Neighbouring lanes of
    a warp compute `run` consecutive pixels of one nonzero, so one load instruction reads `run` consecutive
    input values per nonzero: 8 (one 16-byte fp16 segment, four nonzeros per warp) suits short rows, 32 (a
    warp on one nonzero, fewer cache lines per instruction) long ones. All powers of two; `run` <= `pixels`
    and at most a warp."""

    channels: int
    depth: int
    pixels: int
    warps: int = 4
    splits: int = 1
    run: int = 8

    def __post_init__(self) -> None:
        for name in ("channels", "depth", "pixels", "warps", "splits", "run"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"EllConfig.{name}={value!r}: expected a positive power of two")
        if self.pixels > MAX_PIXELS:
            raise ValueError(f"EllConfig.pixels={self.pixels}: at most {MAX_PIXELS}")
        if self.run > min(self.pixels, WARP):
            raise ValueError(f"EllConfig.run={self.run}: at most pixels ({self.pixels}) and a warp ({WARP})")


@dataclass(frozen=True)
class EllConvWeights:
    """A layer's nonzeros in the ELL chunks of `config` (module docstring); checked at construction like the
    compressed layouts (`tendril.sparse.validation`): dtypes, lengths, one device, `chunk_ptr` from 0 to the
    chunk count and never decreasing, channels in range (-1: a tile's unused lane), offsets in an input plane
    of the layer and at a kernel tap of its stride phase (so every read stays inside the planes), finite
    values."""

    geometry: ConvGeometry
    config: EllConfig
    values: torch.Tensor
    """`[(chunks + 1) * depth * channels]` fp32 weights, chunk by chunk, each `[depth, channels]`."""
    offsets: torch.Tensor
    """int32, alongside `values`: the input offset (the input channel for `POINTWISE`) each weight reads."""
    chunk_ptr: torch.Tensor
    """`[tiles + 1]` int32: tile `t`'s chunks are `chunk_ptr[t]:chunk_ptr[t + 1]`."""
    channels: torch.Tensor
    """`[tiles * channels]` int32: the output channel of each tile lane, -1 for lanes past the last channel."""

    def __post_init__(self) -> None:
        self._check_structure()
        if not capturing(self.values):
            self._check_values()

    @property
    def mode(self) -> int:
        return mode_of(self.geometry)

    @property
    def tiles(self) -> int:
        return int(self.chunk_ptr.numel()) - 1

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.values, self.offsets, self.chunk_ptr, self.channels))

    def _check_structure(self) -> None:
        owner, g, cfg = "EllConvWeights", self.geometry, self.config
        if not isinstance(g, ConvGeometry) or not isinstance(cfg, EllConfig):
            raise TypeError(f"{owner}: expected a ConvGeometry and an EllConfig")
        values = check_tensor(owner, "values", self.values, torch.float32)
        chunk = cfg.depth * cfg.channels
        if values.numel() % chunk or values.numel() == 0:
            raise ValueError(f"{owner}.values: {values.numel()} entries is not a positive multiple of {chunk}")
        check_tensor(owner, "offsets", self.offsets, torch.int32, (values.numel(),), device=values.device)
        tiles = -(-g.out_channels // cfg.channels)
        check_tensor(owner, "chunk_ptr", self.chunk_ptr, torch.int32, (tiles + 1,), device=values.device)
        check_tensor(owner, "channels", self.channels, torch.int32, (tiles * cfg.channels,), device=values.device)

    def _check_values(self) -> None:
        g, cfg = self.geometry, self.config
        checks = ValueChecks("EllConvWeights")
        chunks = self.values.numel() // (cfg.depth * cfg.channels) - 1
        checks.pointer("chunk_ptr", self.chunk_ptr, chunks, f"the {chunks} chunks before the spare one")
        lanes = self.channels.long()
        checks.add(((lanes < -1) | (lanes >= g.out_channels)).any(), "channels: an entry outside [-1, out_channels)")
        offsets = self.offsets.long()
        rows, cols = plane_hw(g)
        planes = g.in_channels * planes_per_channel(g)
        checks.in_range("offsets (input plane)", offsets // (rows * cols), planes, f"{planes} input planes")
        if self.mode != POINTWISE:
            inside = offsets % (rows * cols)
            (kr, ks) = g.plane_kernel
            outside = (inside // cols >= kr) | (inside % cols >= ks)
            checks.add(outside.any(), f"offsets: a kernel tap outside the {kr}×{ks} kernel of a stride phase")
        checks.add(~torch.isfinite(self.values).all(), "values holds NaN or infinity")
        checks.raise_first()


def nonzeros(weights: SparseConvWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each nonzero's output channel, offset (`planes.entry_offsets`) and value, decoded from the compressed
    layout's virtual channels and taps (int64 indices)."""
    g = weights.geometry
    taps = weights.taps.long()
    k, rp, sp = taps >> 16, (taps >> 8) & 0xFF, taps & 0xFF
    virtual = segment_of(weights.channel_ptr, weights.nnz)
    c, phase = virtual // g.phases, virtual % g.phases
    (sh, sw) = g.stride
    r, s = rp * sh + phase // sw, sp * sw + phase % sw
    return k, entry_offsets(g, c, r, s), weights.values


def pack(weights: SparseConvWeights, config: EllConfig) -> EllConvWeights:
    """`weights` in the ELL chunks of `config`, on their device (a few host syncs: run outside graph capture)."""
    g, cfg = weights.geometry, config
    device = weights.values.device
    k, offset, value = nonzeros(weights)
    counts = torch.bincount(k, minlength=g.out_channels)
    order = torch.argsort(counts, descending=True, stable=True)  # lane slot -> output channel
    slot = torch.empty_like(order)
    slot[order] = torch.arange(g.out_channels, device=device)
    tiles = -(-g.out_channels // cfg.channels)
    lane_counts = torch.zeros(tiles * cfg.channels, dtype=torch.long, device=device)
    lane_counts[: g.out_channels] = counts[order]
    tile_chunks = -(-lane_counts.view(tiles, cfg.channels).amax(1) // cfg.depth)
    chunk_ptr = torch.zeros(tiles + 1, dtype=torch.long, device=device)
    chunk_ptr[1:] = torch.cumsum(tile_chunks, 0)
    total = int(chunk_ptr[-1])

    by_channel = torch.argsort(k * (int(offset.max()) + 1 if offset.numel() else 1) + offset)
    k, offset, value = k[by_channel], offset[by_channel], value[by_channel]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(k.numel(), device=device) - first[k]
    tile, lane = slot[k] // cfg.channels, slot[k] % cfg.channels
    entry = ((chunk_ptr[tile] + rank // cfg.depth) * cfg.depth + rank % cfg.depth) * cfg.channels + lane

    size = (total + 1) * cfg.depth * cfg.channels
    values = torch.zeros(size, dtype=torch.float32, device=device)
    offsets = torch.zeros(size, dtype=torch.int32, device=device)
    values[entry] = value.float()
    offsets[entry] = offset.to(torch.int32)
    channels = torch.full((tiles * cfg.channels,), -1, dtype=torch.int32, device=device)
    channels[: g.out_channels] = order.to(torch.int32)
    return EllConvWeights(g, cfg, values, offsets, chunk_ptr.to(torch.int32), channels)
