"""Tiling and weight layout of the register-tiled sparse-weight convolution (`register_cuda.py`),
shared with its CPU emulation (`register_emulation.py`).

Dataflow (output-stationary; zero weights skipped, activations read densely from shared memory):
a thread block of `warps` warps owns an output tile of `tile_h × tile_w` pixels × `k_block`
output channels (`kt` per warp) and one contiguous range of the group's input channels (its
*split*). Every lane of a warp owns the same `kt` output channels and its own `ph × pw` output
pixels, all held in registers (`kt × ph × pw` accumulators); the 32 lanes of a warp cover the whole
pixel tile (`lanes_x` lanes along x, `32 / lanes_x` along y), so the warps of a block share the
staged activations and differ only in their output channels, and every branch on a weight is
warp-uniform. Per round the block stages `c_chunk` input channels into shared memory: the input
tile with its halo (`in_h × in_w`, zeros where the padding is), the channels' weight row records
and their nonzero values. Then for each staged channel and kernel row r each lane loads its patch
row (`ph` rows × `(pw - 1) * sw + s` columns) into registers once, and each nonzero weight
(k, c, r, s) of the warp's channels adds `w × patch` to its `ph × pw` accumulators: one weight
load for `ph × pw` FMAs, and one patch load shared by the warp's `kt` channels and the row's taps.
A channel whose staged tile is all zeros (ReLU's whole-zero planes) is skipped by the whole block.

Weight layout (`RowMaskWeights`), per (k-block, input channel of the group, output channel of the
block, kernel row): one record `mask | offset << 16`, where bit s of the mask says tap (r, s) is
nonzero and `offset` is where the row's values start among the (k-block, channel)'s nonzero values
(kept in (k, r, s) order; `chan_ptr[kb, c]` is the global start). Bytes per nonzero: 4 for the
value plus 4 per (k, c, r) record: `4 + 4 / (S × density)`, about 8.4 at 3×3 and 30% density.

Channel splits: when tiles × k-blocks leave SMs idle, the group's input channels are cut into
`splits` ranges (grid z); each block writes its partial sums to a workspace, and the last block
of a tile to arrive (a ticket counter per tile, reset by that block) adds the partials in split
order, so the result is deterministic, then applies bias, residual and ReLU. With one split the
epilogue is fused into the accumulator write-out.

`plan` picks (ph, pw, kt, lanes_x, splits) with `estimate_us`, a count of issued warp instructions
per SM (patch loads, weight records, tap tests, FMAs) plus the split reduction's traffic; the
network then measures the pick against the other kernels (`SparseNetwork.tune`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tendril.sparse.format import ConvGeometry, SparseConvWeights

WARPS = 8
SHARED_BYTES = 46 * 1024
"""Static shared memory a block may use (48 KiB limit, less a margin for the kernel's scalars)."""
MAX_C_CHUNK = 8
MAX_ACCUMULATORS = 64
MAX_PATCH_FLOATS = 48
MAX_TAPS_PER_ROW = 16
"""A row record's mask has 16 bits: kernels up to 16 taps wide."""
MAX_SPLITS = 16
MIN_CHANNELS_PER_SPLIT = 16
BLOCKS_PER_SM = 2

# Cost model of the H200 (estimate_us): issue slots, clock, memory bandwidth, achieved issue fraction.
WARP_INSTRUCTIONS_PER_CYCLE = 4
CLOCK_GHZ = 1.98
BYTES_PER_US = 3.0e6
ISSUE_EFFICIENCY = 0.6
LAUNCH_US = 3.0


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

    @property
    def lanes_y(self) -> int:
        return 32 // self.lanes_x

    @property
    def tile_hw(self) -> tuple[int, int]:
        return self.lanes_y * self.ph, self.lanes_x * self.pw

    @property
    def k_block(self) -> int:
        return self.warps * self.kt

    @property
    def patch_w(self) -> int:
        return (self.pw - 1) * self.geometry.stride[1] + self.geometry.kernel[1]

    @property
    def in_hw(self) -> tuple[int, int]:
        """Input tile (with halo) a block stages per channel."""
        (th, tw), (sh, sw), (r, s) = self.tile_hw, self.geometry.stride, self.geometry.kernel
        return (th - 1) * sh + r, (tw - 1) * sw + s

    @property
    def in_w_pad(self) -> int:
        """Row stride of the staged tile: a multiple of 4 so that patch rows load as float4."""
        return -(-self.in_hw[1] // 4) * 4

    @property
    def vector_loads(self) -> bool:
        return self.geometry.stride[1] == 1 and self.pw % 4 == 0

    @property
    def tiles(self) -> tuple[int, int]:
        (oh, ow), (th, tw) = self.geometry.out_hw, self.tile_hw
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
    def value_capacity(self) -> int:
        """Nonzero values one staged round can hold (every weight of `c_chunk` channels nonzero)."""
        r, s = self.geometry.kernel
        return self.c_chunk * self.k_block * r * s

    @property
    def shared_bytes(self) -> int:
        return _shared_bytes(self, self.c_chunk)

    def defines(self) -> tuple[str, ...]:
        """The NVRTC `-D` options that specialise the kernel source for this plan."""
        g = self.geometry
        values = {
            "R": g.kernel[0],
            "S": g.kernel[1],
            "SH": g.stride[0],
            "SW": g.stride[1],
            "PADH": g.padding[0],
            "PADW": g.padding[1],
            "PH": self.ph,
            "PW": self.pw,
            "KT": self.kt,
            "LANES_X": self.lanes_x,
            "WARPS": self.warps,
            "C_CHUNK": self.c_chunk,
            "IN_H": self.in_hw[0],
            "IN_W": self.in_hw[1],
            "IN_W_PAD": self.in_w_pad,
            "VAL_CAP": self.value_capacity,
            "VECTOR_LOADS": int(self.vector_loads),
        }
        return tuple(f"-D{k}={v}" for k, v in values.items())


def _shared_bytes(plan: RegisterTilePlan, c_chunk: int) -> int:
    (in_h, _), (r, s) = plan.in_hw, plan.geometry.kernel
    act = c_chunk * in_h * plan.in_w_pad
    records = c_chunk * plan.k_block * r
    values = c_chunk * plan.k_block * r * s
    return 4 * (act + records + values + 2 * c_chunk + 1)


def unsupported_reason(geometry: ConvGeometry) -> str | None:
    """Why the kernel cannot run this geometry, or None when it can."""
    if geometry.kernel[1] > MAX_TAPS_PER_ROW:
        return f"kernel width {geometry.kernel[1]} exceeds the row record's {MAX_TAPS_PER_ROW} tap bits"
    if not candidates(geometry, 1.0, 132):
        return "no tile configuration fits the shared memory and register limits"
    return None


def candidates(geometry: ConvGeometry, weight_density: float, sms: int) -> list[RegisterTilePlan]:
    """Every feasible plan for this geometry, cheapest first by `estimate_us`."""
    plans = []
    for ph in (4, 2, 1):
        for pw in (4, 2, 1):
            for kt in (4, 2, 1):
                for lanes_x in (4, 8, 16):
                    base = RegisterTilePlan(geometry, ph, pw, kt, lanes_x, 1, 1)
                    if kt * ph * pw > MAX_ACCUMULATORS or ph * base.patch_w > MAX_PATCH_FLOATS:
                        continue
                    if geometry.kernel[1] > MAX_TAPS_PER_ROW or _shared_bytes(base, 1) > SHARED_BYTES:
                        continue
                    c_chunk = min(MAX_C_CHUNK, base.group_in)
                    while _shared_bytes(base, c_chunk) > SHARED_BYTES:
                        c_chunk -= 1
                    tiles = base.grid[0] * base.k_blocks
                    useful = max(1, base.group_in // MIN_CHANNELS_PER_SPLIT)
                    wanted = -(-BLOCKS_PER_SM * sms // tiles)
                    for splits in sorted({1, max(1, min(MAX_SPLITS, useful, wanted))}):
                        plan = RegisterTilePlan(geometry, ph, pw, kt, lanes_x, splits, min(c_chunk, base.group_in))
                        plans.append(plan)
    return sorted(plans, key=lambda p: estimate_us(p, weight_density, sms))


def plan(geometry: ConvGeometry, weight_density: float, sms: int) -> RegisterTilePlan:
    """The plan `estimate_us` predicts fastest; raises if the kernel does not support the geometry."""
    reason = unsupported_reason(geometry)
    if reason is not None:
        raise ValueError(f"register-tiled conv cannot run {geometry}: {reason}")
    return candidates(geometry, weight_density, sms)[0]


def estimate_us(plan: RegisterTilePlan, weight_density: float, sms: int) -> float:
    """Predicted microseconds on an H200-class GPU: warp instructions issued by the busiest SM, plus
    the split reduction's workspace traffic and a launch."""
    g = plan.geometry
    r, s = g.kernel
    patch_instructions = plan.ph * (math.ceil(plan.patch_w / 4) + 1 if plan.vector_loads else plan.patch_w)
    taps = s * weight_density
    per_row = patch_instructions + plan.kt * (3 + s + taps * (plan.ph * plan.pw + 2))
    per_channel = r * per_row
    blocks = plan.grid[0] * plan.grid[1] * plan.grid[2]
    staging = plan.in_hw[0] * plan.in_w_pad / 32 * 3 / plan.warps
    per_block = plan.warps * plan.split_channels * (per_channel + staging)
    waves = math.ceil(blocks / (BLOCKS_PER_SM * sms))
    cycles = waves * BLOCKS_PER_SM * per_block / (WARP_INSTRUCTIONS_PER_CYCLE * ISSUE_EFFICIENCY)
    split_bytes = 0 if plan.splits == 1 else 8 * plan.splits * g.out_channels * g.out_hw[0] * g.out_hw[1]
    return LAUNCH_US + cycles / (CLOCK_GHZ * 1e3) + split_bytes / BYTES_PER_US


@dataclass(frozen=True)
class RowMaskWeights:
    """A layer's nonzero weights in the kernel's row-record layout (see the module docstring)."""

    plan: RegisterTilePlan
    values: torch.Tensor
    """fp32 nonzeros in (k-block, channel, k, r, s) order."""
    records: torch.Tensor
    """`[k_blocks, group_in, k_block, R]` int32: `tap mask | offset << 16`."""
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
        dense = weights.to_dense()  # [K, group_in, R, S]
        padded_out = tile_plan.k_blocks_per_group * kb
        grouped = dense.view(g.groups, tile_plan.group_out, tile_plan.group_in, r, s)
        padded = torch.zeros(g.groups, padded_out, tile_plan.group_in, r, s, device=dense.device)
        padded[:, : tile_plan.group_out] = grouped
        blocked = padded.view(tile_plan.k_blocks, kb, tile_plan.group_in, r, s).permute(0, 2, 1, 3, 4).contiguous()
        nonzero = blocked != 0
        bits = torch.tensor([1 << t for t in range(s)], dtype=torch.int64, device=dense.device)
        masks = (nonzero.long() * bits).sum(-1)  # [k_blocks, group_in, kb, R]
        per_row = nonzero.sum(-1).view(tile_plan.k_blocks, tile_plan.group_in, kb * r)
        offsets = (torch.cumsum(per_row, -1) - per_row).view_as(masks)
        per_channel = per_row.sum(-1)  # [k_blocks, group_in]
        chan_ptr = _channel_starts(per_channel)
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
