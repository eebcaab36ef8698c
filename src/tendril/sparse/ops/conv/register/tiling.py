"""Tiling and weight layout of the register-tiled sparse-weight convolution (`kernel.py`), shared with
its CPU emulation (`emulation.py`); `planner.py` chooses a layer's plan.

Dataflow (output-stationary; zero weights skipped, activations read densely from shared memory):
a thread block of `warps` warps owns an output tile of `tile_h × tile_w` pixels × `k_block`
output channels (`kt` per warp) and one contiguous range of the group's input channels (its
*split*). Every lane of a warp owns the same `kt` output channels and its own `ph × pw` output
pixels, all held in registers (`kt × ph × pw` accumulators); the lanes of a warp cover the whole
pixel tile (`lanes_x` along x, `lanes_y = 32 // lanes_x` along y; lanes past `lanes_x × lanes_y`
idle), so the warps of a block share the staged activations and differ only in their output
channels, and every branch on a weight is warp-uniform.

The block stages `c_chunk` input channels per round into shared memory with `cp.async`, double
buffered (the next round's copies fly while this round computes): the input tile with its halo
(`in_h × in_w`, zeros where the padding is, rows `pitch` floats apart), the channels' row records
and their nonzero values. For each staged channel a lane loads its input *window*
(`((ph - 1) sh + R) × ((pw - 1) sw + S)` floats, with vector loads where aligned) into registers
once, each row at the first kernel row that needs it, and every nonzero weight (k, c, r, s) of the
warp's channels adds `w × window[i sh + r][j sw + s]` to its `ph × pw` accumulators, all indices
compile-time constants (no local memory). So a staged float is read from shared memory once per
channel and lane, not once per kernel row, and feeds `kt × taps` FMAs.

Weight layout (`RowMaskWeights`), per (k-block, input channel of the group, kernel row, output
channel of the block): one record `mask | offset << 16`, where bit s of the mask says tap (r, s) is
nonzero and `offset` is where the row's values start among the (k-block, channel)'s nonzero values
(kept in (r, k, s) order; `chan_ptr[kb, c]` is the global start). A warp's `kt` records of one row
are adjacent, so they load as one vector. Bytes per nonzero: 4 for the value plus 4 per (k, c, r)
record: `4 + 4 / (S × density)`, about 8.4 at 3×3 and 30% density.

Channel splits: when tiles × k-blocks leave SMs idle, the group's input channels are cut into
`splits` ranges (grid z); each block writes its partial sums to a workspace, and the last block
of a tile to arrive (a ticket counter per tile, reset by that block) adds the partials in split
order, so the result is deterministic, then applies bias, residual and ReLU. With one split the
epilogue is fused into the accumulator write-out.

Pixel runs (`pixel_run=True`, 1×1 kernels without padding, any stride): a 1×1 convolution is a
sparse × dense matrix product, `[K, C]` weights times the `[C, H·W]` input, and the 2-D tile's
machinery (halos, windows, per-(k, c) records of one tap each) is overhead there. A pixel-run block
owns a run of `32 × pw` output pixels in flattened (row-major) order instead of a 2-D tile: it stages
each input channel's run as one contiguous vector (strided inputs gathered by the copies, so the
staged run is dense), every lane owns `pw` pixels of it as `pw / vector` groups of `vector` adjacent
pixels (group g of lane l starts at `g × 32 × vector + l × vector`: conflict-free vector loads from
shared memory and fully coalesced vector stores), and one record per (k-block, channel, warp) holds
the mask of the warp's `kt` output channels (bit kk: weight (k0 + kk, c) is nonzero) and the offset of
their values, so each nonzero weight costs one broadcast load and `pw` FMAs. Channel splits, the
ticketed reduction, the fused epilogue and the nonzero counts work as for tiles (a tile's share of the
input plane is its `1 / tiles` slice of the flattened plane).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from tendril.sparse.format import ConvGeometry, SparseConvWeights

WARPS = 8
SHARED_BYTES = 46 * 1024
"""Static shared memory a block may use (48 KiB limit, less a margin for the kernel's scalars)."""
SM_SHARED_BYTES = 227 * 1024
SM_REGISTERS = 65536
SM_MAX_WARPS = 64
MAX_C_CHUNK = 8
MAX_REGISTERS = 232
"""Estimated registers per thread a plan may need (255 is the hardware limit; margin for the estimate)."""
MAX_TAPS_PER_RECORD = 16
"""A record's mask has 16 bits: kernels up to 16 taps wide (one record per row), or whole kernels of up to
16 taps (one record per (k, c))."""
MAX_SPLITS = 16
MIN_CHANNELS_PER_SPLIT = 16
LANES_X_CHOICES = (1, 2, 3, 4, 5, 6, 7, 8, 10, 14, 15, 16, 28, 32)
"""Lane columns per warp: every count that keeps at least 28 of the 32 lanes busy (14 × 2, 7 × 4, ...)."""
PIXEL_RUN_PW = (1, 2, 4, 8, 12, 16)
"""Pixels per lane of a pixel-run plan: multiples of the vector width (4, 2 or 1) that it loads and stores."""
PIXEL_RUN_KT = (1, 2, 4, 8, 16)
"""Output channels per warp of a pixel-run plan: its record's mask has a bit for each (16 at most)."""


@dataclass(frozen=True)
class RegisterTilePlan:
    """One compiled configuration of the kernel for one convolution geometry."""

    geometry: ConvGeometry
    ph: int
    pw: int
    kt: int
    lanes_x: int
    splits: int
    c_chunk: int
    warps: int = WARPS
    pixel_run: bool = False
    """Blocks own runs of `32 × pw` flattened output pixels (1×1 kernels, see the module docstring)."""

    def __post_init__(self) -> None:
        if self.pixel_run:
            g = self.geometry
            if g.kernel != (1, 1) or g.padding != (0, 0):
                raise ValueError(f"a pixel-run plan needs a 1×1 kernel without padding, got {g}")
            if self.ph != 1 or self.lanes_x != 32 or self.pw not in PIXEL_RUN_PW or self.kt not in PIXEL_RUN_KT:
                raise ValueError(
                    f"a pixel-run plan needs ph 1, lanes_x 32, pw in {PIXEL_RUN_PW} and kt in {PIXEL_RUN_KT}; "
                    f"got ph {self.ph}, lanes_x {self.lanes_x}, pw {self.pw}, kt {self.kt}"
                )

    @property
    def lanes_y(self) -> int:
        return 32 // self.lanes_x

    @property
    def active_lanes(self) -> int:
        return self.lanes_x * self.lanes_y

    @property
    def tile_hw(self) -> tuple[int, int]:
        """Output pixels a block owns, rows × columns (a pixel run: one row of flattened pixels)."""
        return self.lanes_y * self.ph, self.lanes_x * self.pw

    @property
    def out_extent_hw(self) -> tuple[int, int]:
        """The output plane as the tiles cover it: the geometry's, or one row of H·W pixels for pixel runs."""
        (oh, ow) = self.geometry.out_hw
        return (1, oh * ow) if self.pixel_run else (oh, ow)

    @property
    def k_block(self) -> int:
        return self.warps * self.kt

    @property
    def window_hw(self) -> tuple[int, int]:
        """Input floats one lane reads per channel: rows × columns."""
        if self.pixel_run:
            return 1, self.pw  # the staged run is already gathered densely
        (sh, sw), (r, s) = self.geometry.stride, self.geometry.kernel
        return (self.ph - 1) * sh + r, (self.pw - 1) * sw + s

    @property
    def in_hw(self) -> tuple[int, int]:
        """Input tile (with halo) a block stages per channel."""
        if self.pixel_run:
            return self.tile_hw
        (th, tw), (sh, sw), (r, s) = self.tile_hw, self.geometry.stride, self.geometry.kernel
        return (th - 1) * sh + r, (tw - 1) * sw + s

    @property
    def vector(self) -> int:
        """Widest load (floats) at which every lane's window rows are aligned: 4, 2 or 1 (pixel runs: the
        width of a lane's groups of adjacent pixels)."""
        step = self.pw if self.pixel_run else self.pw * self.geometry.stride[1]
        return 4 if step % 4 == 0 else 2 if step % 2 == 0 else 1

    @property
    def pitch(self) -> int:
        """Row stride (floats) of the staged tile: a multiple of `vector`, chosen for the fewest bank conflicts."""
        if self.pixel_run:
            return self.in_hw[1]
        return _best_pitch(self.in_hw[1], self.vector, _lane_step(self), self.window_hw[1])[0]

    @property
    def window_row_wavefronts(self) -> int:
        """Shared-memory wavefronts a warp's load of one window row costs (bank conflicts included)."""
        if self.pixel_run:
            return self.pw  # `pw / vector` loads of adjacent vectors across the warp, `vector` wavefronts each
        return _best_pitch(self.in_hw[1], self.vector, _lane_step(self), self.window_hw[1])[1]

    @property
    def tiles(self) -> tuple[int, int]:
        (oh, ow), (th, tw) = self.out_extent_hw, self.tile_hw
        return -(-oh // th), -(-ow // tw)

    @property
    def group_in(self) -> int:
        return self.geometry.in_channels // self.geometry.groups

    @property
    def group_out(self) -> int:
        return self.geometry.out_channels // self.geometry.groups

    @property
    def k_blocks_per_group(self) -> int:
        return -(-self.group_out // self.k_block)

    @property
    def k_blocks(self) -> int:
        return self.geometry.groups * self.k_blocks_per_group

    @property
    def split_channels(self) -> int:
        return -(-self.group_in // self.splits)

    @property
    def grid(self) -> tuple[int, int, int]:
        ty, tx = self.tiles
        return ty * tx, self.k_blocks, self.splits

    @property
    def record_rows(self) -> int:
        """Kernel rows one record covers: all of them when their taps fit its 16 mask bits (3×3, 1×1), else one."""
        r, s = self.geometry.kernel
        return r if r * s <= MAX_TAPS_PER_RECORD else 1

    @property
    def record_groups(self) -> int:
        return self.geometry.kernel[0] // self.record_rows

    @property
    def records_per_channel(self) -> int:
        """Records of one (k-block, channel): one per (row group, k), or one per warp for pixel runs."""
        return self.warps if self.pixel_run else self.record_groups * self.k_block

    @property
    def value_capacity(self) -> int:
        """Nonzero values one staged round can hold (every weight of `c_chunk` channels nonzero)."""
        r, s = self.geometry.kernel
        return self.c_chunk * self.k_block * r * s

    @property
    def shared_bytes(self) -> int:
        return shared_bytes_for(self, self.c_chunk)

    @property
    def registers(self) -> int:
        """Estimated registers per thread: accumulators, the live window, records and ~40 for addresses."""
        if self.pixel_run:  # besides accumulators and window: what NVRTC's sm_90 builds of 1×1 layers use
            return self.kt * self.pw + self.pw + 52
        return self.kt * self.ph * self.pw + _peak_window_floats(self) + self.kt + 40

    @property
    def blocks_per_sm(self) -> int:
        """Blocks an SM holds at once (registers, shared memory, warps), at most 4; the launch bound."""
        threads = 32 * self.warps
        by_registers = SM_REGISTERS // (threads * (-(-self.registers // 8) * 8))
        by_shared = SM_SHARED_BYTES // (self.shared_bytes + 1024)
        return max(1, min(4, by_registers, by_shared, SM_MAX_WARPS // self.warps))


def _lane_step(plan: RegisterTilePlan) -> tuple[int, int, int, int]:
    """(lanes_x, lanes_y, rows between lane rows, columns between lane columns) for the bank model."""
    (sh, sw) = plan.geometry.stride
    return plan.lanes_x, plan.lanes_y, plan.ph * sh, plan.pw * sw


def shared_bytes_for(plan: RegisterTilePlan, c_chunk: int) -> int:
    """Two staging buffers (activations, records, values) plus the split's channel starts."""
    r, s = plan.geometry.kernel
    act = c_chunk * plan.in_hw[0] * plan.pitch
    records = c_chunk * plan.records_per_channel
    values = c_chunk * plan.k_block * r * s
    return 4 * (2 * (act + records + values) + plan.split_channels + 2)


def _row_group_uses(plan: RegisterTilePlan, q: int) -> tuple[int, ...]:
    """The row groups whose pass reads window row `q` (`i sh + r == q`)."""
    return _uses(plan.geometry.stride[0], plan.geometry.kernel[0], plan.ph, plan.record_rows, q)


@functools.lru_cache(maxsize=8192)
def _uses(sh: int, r_size: int, ph: int, record_rows: int, q: int) -> tuple[int, ...]:
    return tuple(r // record_rows for r in range(r_size) for i in range(ph) if i * sh + r == q)


def first_use(plan: RegisterTilePlan, q: int) -> int | None:
    """The first row group whose pass reads window row `q`, None when none does (the kernel loads it then)."""
    uses = _row_group_uses(plan, q)
    return min(uses) if uses else None


@functools.lru_cache(maxsize=8192)
def _peak_window_floats(plan: RegisterTilePlan) -> int:
    """Most window floats live at once when each row is loaded at its first use and dropped after its last."""
    rows, width = plan.window_hw
    spans = [(min(u), max(u)) for u in (_row_group_uses(plan, q) for q in range(rows)) if u]
    return width * max(sum(1 for lo, hi in spans if lo <= g <= hi) for g in range(plan.record_groups))


def row_loads(width: int, vector: int) -> list[tuple[int, int]]:
    """(first column, floats) of the loads that read one window row: widest vectors first, as the kernel does."""
    loads, j = [], 0
    for v in (4, 2, 1):
        if v > vector:
            continue
        while j + v <= width and j % v == 0:
            loads.append((j, v))
            j += v
    return loads


@functools.lru_cache(maxsize=4096)
def _best_pitch(in_w: int, vector: int, lanes: tuple[int, int, int, int], width: int) -> tuple[int, int]:
    """(pitch, wavefronts per window row) with the fewest wavefronts, the smallest such pitch. A load's
    conflicts do not depend on its column (all lanes shift alike), only on the pitch modulo 32."""
    base = -(-in_w // vector) * vector
    best = None
    lanes_x, lanes_y, row_step, col_step = lanes
    for pitch in range(base, base + 32, vector):
        # Banks depend on offsets modulo 32; adding 1024 keeps the words of different lane rows distinct.
        pattern = (lanes_x, lanes_y, row_step * pitch % 32 + 1024, col_step)
        wavefronts = sum(_wavefronts(pattern, v) for _, v in row_loads(width, vector))
        if best is None or wavefronts < best[1]:
            best = (pitch, wavefronts)
    assert best is not None
    return best


@functools.lru_cache(maxsize=8192)
def _wavefronts(pattern: tuple[int, int, int, int], floats: int) -> int:
    """Wavefronts of one warp-wide shared load of `floats` per lane: the warp is served in groups of
    lanes (the whole warp for 4-byte loads, halves for 8-byte, quarters for 16-byte ones), and within a
    group each extra distinct word that falls in an already used bank costs a wavefront. `pattern` is
    (lanes_x, lanes_y, words between lane rows, words between lane columns)."""
    lanes_x, lanes_y, row_words, col_words = pattern
    group = 32 // floats if floats > 1 else 32
    total = 0
    for first in range(0, 32, group):
        banks: dict[int, set[int]] = {}
        for lane in range(first, first + group):
            source = min(lane, lanes_x * lanes_y - 1)  # idle lanes read what the last active lane reads
            word = (source // lanes_x) * row_words + (source % lanes_x) * col_words
            for f in range(floats):
                banks.setdefault((word + f) % 32, set()).add(word + f)
        total += max(len(words) for words in banks.values())
    return total


@dataclass(frozen=True)
class RowMaskWeights:
    """A layer's nonzero weights in the kernel's row-record layout (see the module docstring)."""

    plan: RegisterTilePlan
    values: torch.Tensor
    """fp32 nonzeros in (k-block, channel, row group, k, row of the group, s) order."""
    records: torch.Tensor
    """`[k_blocks, group_in, row groups, k_block]` int32: `tap mask | offset << 16`; bit `rr × S + s` is tap
    (group × record_rows + rr, s). Pixel runs: `[k_blocks, group_in, 1, warps]`, `channel mask | offset << 16`
    where bit kk is output channel `warp × kt + kk` of the block and the offset is that of the warp's first."""
    chan_ptr: torch.Tensor
    """`[k_blocks, group_in + 1]` int32: start of each (k-block, channel)'s values in `values`."""

    @property
    def nbytes(self) -> int:
        return 4 * (self.values.numel() + self.records.numel() + self.chan_ptr.numel())

    @classmethod
    def prepare(cls, weights: SparseConvWeights, tile_plan: RegisterTilePlan) -> RowMaskWeights:
        g = weights.geometry
        if tile_plan.geometry != g:
            raise ValueError("the plan was made for a different geometry")
        (r, s), kb = g.kernel, tile_plan.k_block
        groups, rows = tile_plan.record_groups, tile_plan.record_rows
        dense = weights.to_dense()  # [K, group_in, R, S]
        padded_out = tile_plan.k_blocks_per_group * kb
        grouped = dense.view(g.groups, tile_plan.group_out, tile_plan.group_in, r, s)
        padded = torch.zeros(g.groups, padded_out, tile_plan.group_in, r, s, device=dense.device)
        padded[:, : tile_plan.group_out] = grouped
        # [k_blocks, group_in, row groups, k_block, rows × S]: a (k-block, channel)'s values in record order
        blocked = (
            padded.view(tile_plan.k_blocks, kb, tile_plan.group_in, groups, rows * s)
            .permute(0, 2, 3, 1, 4)
            .contiguous()
        )
        nonzero = blocked != 0
        bits = torch.tensor([1 << t for t in range(rows * s)], dtype=torch.int64, device=dense.device)
        masks = (nonzero.long() * bits).sum(-1)  # [k_blocks, group_in, groups, kb]
        per_row = nonzero.sum(-1).view(tile_plan.k_blocks, tile_plan.group_in, groups * kb)
        offsets = (torch.cumsum(per_row, -1) - per_row).view_as(masks)
        per_channel = per_row.sum(-1)  # [k_blocks, group_in]
        chan_ptr = _channel_starts(per_channel)
        if tile_plan.pixel_run:  # one record per warp: bit kk for output channel warp × kt + kk (1×1: bit 0 each)
            k_blocks, warps, kt = tile_plan.k_blocks, tile_plan.warps, tile_plan.kt
            shifts = torch.arange(kt, device=dense.device)
            masks = (masks.view(k_blocks, tile_plan.group_in, warps, kt) << shifts).sum(-1)[:, :, None]
            offsets = offsets.view(k_blocks, tile_plan.group_in, warps, kt)[..., 0][:, :, None]
        records = (masks | (offsets << 16)).to(torch.int32).contiguous()
        return cls(tile_plan, blocked[nonzero].contiguous(), records, chan_ptr.to(torch.int32).contiguous())


def _channel_starts(per_channel: torch.Tensor) -> torch.Tensor:
    """`[k_blocks, channels + 1]` global starts: row kb's last entry is where block kb + 1 begins."""
    k_blocks, channels = per_channel.shape
    ends = torch.cumsum(per_channel.reshape(-1), 0).view(k_blocks, channels)
    starts = torch.empty(k_blocks, channels + 1, dtype=torch.int64, device=per_channel.device)
    starts[:, 1:] = ends
    starts[:, 0] = ends[:, 0] - per_channel[:, 0]
    return starts
