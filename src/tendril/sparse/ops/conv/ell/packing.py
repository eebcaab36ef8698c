"""The ELL layout the `"ell"` kernel reads, packed once per layer and tile config from the compressed weights.

Output channels are sorted by nonzero count (most first) and grouped `channels` at a time into *tiles*; a
tile's nonzeros are stored as *chunks* of `[depth, channels]` entries: chunk row `j` of the tile's `i`-th chunk
holds each channel's nonzero number `i * depth + j`. A tile is padded with zero weights to its longest
channel's count rounded up to `depth`, so after sorting the padding is the spread of counts within a tile
plus less than `depth` per channel, and a kernel program walks exactly its tile's chunks: work follows the
nonzeros, and the inner loop holds no mask.

Each entry is a weight (fp32, so half-precision weights are held exactly) and the input offset it reads, in
one of three reading modes (`mode_of`):
- `POINTWISE` (1×1 kernel, stride 1, no padding): the input channel `c` alone; the kernel reads `c * H * W`
  plus the pixel, masked at the end of the plane, and Triton knows the plane size is a multiple of 16 where it
  is, so the loads of a pixel run vectorise;
- `SHIFTED` (other stride-1 layers): the flat offset `c * Hq * Wq + r * Wq + s` of kernel tap `(r, s)` of input
  channel `c` in a copy of the input zero-padded by the layer's padding plus `slack_rows` rows at the bottom
  (`padded_hw`). The kernel computes a *virtual* output plane of `OH` rows of `Wq` pixels, pixel `q` reading
  entry offset + `q`: the same constant distance for every entry, so that a thread's loads are one address
  plus immediate offsets. The virtual columns past `OW` read the next row (or the slack) and are not stored;
- `STRIDED` (stride above 1): the flat offset as in `SHIFTED` in the input zero-padded by the layer's padding
  (no copy when there is none, no slack), output pixel `(oy, ox)` reading entry offset + `oy * sh * Wq + ox * sw`.
Every read lies inside the (copied) input with no check. A padding entry is weight 0 at offset 0 (a valid
address). One spare chunk of zeros follows the last tile, so the kernel's prefetch of the chunk after a tile's
last stays in bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.validation import ValueChecks, capturing, check_tensor, segment_of


@dataclass(frozen=True)
class EllConfig:
    """One tile shape of the kernel: a program computes `channels` output channels × `pixels` output pixels,
    `depth` nonzeros per channel per loop step, with `warps` warps. All but `warps` are powers of two."""

    channels: int
    depth: int
    pixels: int
    warps: int = 4

    def __post_init__(self) -> None:
        for name in ("channels", "depth", "pixels", "warps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"EllConfig.{name}={value!r}: expected a positive power of two")
        if self.pixels > MAX_PIXELS:
            raise ValueError(f"EllConfig.pixels={self.pixels}: at most {MAX_PIXELS}")


POINTWISE, SHIFTED, STRIDED = 0, 1, 2
"""The kernel's reading modes (module docstring)."""
MAX_PIXELS = 512
"""The longest pixel block of a config: what the `SHIFTED` copy's slack rows cover."""


def mode_of(geometry: ConvGeometry) -> int:
    g = geometry
    if g.stride != (1, 1):
        return STRIDED
    return POINTWISE if g.kernel == (1, 1) and g.padding == (0, 0) else SHIFTED


def padded_hw(geometry: ConvGeometry) -> tuple[int, int]:
    """Rows and columns of each input channel as the kernel reads it: zero-padded by the layer's padding, plus
    `slack_rows(geometry)` rows."""
    (h, w), (ph, pw) = geometry.in_hw, geometry.padding
    return h + 2 * ph + slack_rows(geometry), w + 2 * pw


def slack_rows(geometry: ConvGeometry) -> int:
    """Zero rows below the padded input of a `SHIFTED` layer, enough for the virtual pixels of the last pixel
    block (up to `MAX_PIXELS` past the plane) to read inside the copy; none in the other modes."""
    if mode_of(geometry) != SHIFTED:
        return 0
    return -(-MAX_PIXELS // (geometry.in_hw[1] + 2 * geometry.padding[1])) + 1


def virtual_width(geometry: ConvGeometry) -> int:
    """Pixels per row of the plane the kernel computes (`padded_hw`'s columns for `SHIFTED` layers, else the
    output's)."""
    return padded_hw(geometry)[1] if mode_of(geometry) == SHIFTED else geometry.out_hw[1]


@dataclass(frozen=True)
class EllConvWeights:
    """A layer's nonzeros in the ELL chunks of `config` (module docstring); checked at construction like the
    compressed layouts (`tendril.sparse.validation`): dtypes, lengths, one device, `chunk_ptr` from 0 to the
    chunk count and never decreasing, channels in range (-1: a tile's unused lane), offsets inside the
    padded input for every output pixel."""

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
        if self.mode == POINTWISE:
            checks.in_range("offsets (input channel)", offsets, g.in_channels, "in_channels")
        else:
            hp, wp = padded_hw(g)
            checks.in_range("offsets (input channel)", offsets // (hp * wp), g.in_channels, "in_channels")
            inside = offsets % (hp * wp)
            outside = (inside // wp >= g.kernel[0]) | (inside % wp >= g.kernel[1])
            checks.add(outside.any(), f"offsets: a kernel tap outside the {g.kernel[0]}×{g.kernel[1]} kernel")
        checks.add(~torch.isfinite(self.values).all(), "values holds NaN or infinity")
        checks.raise_first()


def nonzeros(weights: SparseConvWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each nonzero's output channel, input offset (as `EllConvWeights.offsets`) and value, decoded from the
    compressed layout's virtual channels and taps (int64 indices)."""
    g = weights.geometry
    taps = weights.taps.long()
    k, rp, sp = taps >> 16, (taps >> 8) & 0xFF, taps & 0xFF
    virtual = segment_of(weights.channel_ptr, weights.nnz)
    c, phase = virtual // g.phases, virtual % g.phases
    if mode_of(g) == POINTWISE:
        return k, c, weights.values
    (sh, sw), (hp, wp) = g.stride, padded_hw(g)
    r, s = rp * sh + phase // sw, sp * sw + phase % sw
    return k, c * (hp * wp) + r * wp + s, weights.values


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
