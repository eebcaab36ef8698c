"""Planner of the register-tiled sparse-weight convolution: which `RegisterTilePlan` to run a layer with.

`plan` picks (ph, pw, kt, lanes_x, warps, splits) with `estimate_us`, a model of the busiest SM:
issue slots (window and record loads, tap tests, weight loads, FMAs) against shared-memory
wavefronts (bank conflicts of the window loads simulated for the chosen pitch), the occupancy the
registers allow, the L2 traffic of staging and of the split reduction, and the 32-byte sectors the
lanes' output (or partial-sum) stores touch, with constants fitted to measured plans; the network
then measures the best few plans on the device (`SparseNetwork.tune`, `shortlist`). Pixel-run plans
use the tile model's terms (same constants) applied to their own instruction, wavefront and store
counts; the constants are fitted on 2-D tiles only.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from tendril.sparse.format import ConvGeometry
from tendril.sparse.ops.conv.register.tiling import (
    LANES_X_CHOICES,
    MAX_C_CHUNK,
    MAX_REGISTERS,
    MAX_SPLITS,
    MAX_TAPS_PER_RECORD,
    MIN_CHANNELS_PER_SPLIT,
    PIXEL_RUN_KT,
    PIXEL_RUN_PW,
    SHARED_BYTES,
    RegisterTilePlan,
    first_use,
    row_loads,
    shared_bytes_for,
)

# Cost model of the target GPU (estimate_us). Per SM and cycle: 4 warp instructions issued, 1 shared-memory
# wavefront (32 banks × 4 bytes); the SM clock; the fraction of issue slots a well-occupied SM fills; L2 bandwidth.
WARP_INSTRUCTIONS_PER_CYCLE = 4
CLOCK_GHZ = 1.98
ISSUE_EFFICIENCY = 0.7
WARPS_TO_HIDE_LATENCY = 16
L2_BYTES_PER_US = 5.5e6
# Fitted by least squares on relative error to the measured plans of VGG-16's conv layers
# (benchmarks/results/sparse-conv-kernels.json): the main loop's cycles per modelled cycle (latencies the
# issue/wavefront count does not see), the SM cycles of each 32-byte sector a warp's scalar output stores touch
# (why plans whose lanes store adjacent pixels win), and a launch with its prologue and epilogue.
MEASURED_CYCLES_PER_MODELLED = 2.3
STORE_CYCLES_PER_SECTOR = 2.3
FIXED_US = 6.5
RECORD_INSTRUCTIONS = 12
"""Per record: the uniform reduction, moves, tap predicates and the address of its values (sm_90 SASS)."""


def unsupported_reason(geometry: ConvGeometry) -> str | None:
    """Why the kernel cannot run this geometry, or None when it can."""
    if geometry.kernel[1] > MAX_TAPS_PER_RECORD:
        return f"kernel width {geometry.kernel[1]} exceeds the row record's {MAX_TAPS_PER_RECORD} tap bits"
    if not _feasible(geometry, 132):
        return "no tile configuration fits the shared memory and register limits"
    return None


@functools.lru_cache(maxsize=256)
def _feasible(geometry: ConvGeometry, sms: int) -> tuple[RegisterTilePlan, ...]:
    """Every plan that fits the limits (split counts chosen to fill `sms`), in no particular order: 2-D
    tiles, and pixel runs where the geometry is a 1×1 kernel without padding."""
    if geometry.kernel[1] > MAX_TAPS_PER_RECORD:
        return ()
    bases = [
        RegisterTilePlan(geometry, ph, pw, kt, lanes_x, 1, 1, warps)
        for warps in (8, 4)
        for ph in (8, 4, 2, 1)
        for pw in (8, 4, 2, 1)
        for kt in (8, 4, 2, 1)
        for lanes_x in LANES_X_CHOICES
    ]
    if geometry.kernel == (1, 1) and geometry.padding == (0, 0):
        bases += [
            RegisterTilePlan(geometry, 1, pw, kt, 32, 1, 1, warps, pixel_run=True)
            for warps in (8, 4)
            for pw in PIXEL_RUN_PW
            for kt in PIXEL_RUN_KT
        ]
    plans = []
    for base in bases:
        if not _worth_planning(base) or base.registers > MAX_REGISTERS or shared_bytes_for(base, 1) > SHARED_BYTES:
            continue
        plans += _chunked_and_split(base, sms)
    return tuple(plans)


def _chunked_and_split(base: RegisterTilePlan, sms: int) -> list[RegisterTilePlan]:
    """`base` with the most channels per staged round that fit, and the split counts worth trying."""
    c_chunk = min(MAX_C_CHUNK, base.group_in)
    while c_chunk > 1 and shared_bytes_for(base, c_chunk) > SHARED_BYTES:
        c_chunk -= 1
    blocks = base.grid[0] * base.k_blocks
    useful = max(1, min(MAX_SPLITS, base.group_in // MIN_CHANNELS_PER_SPLIT))
    wanted = -(-base.blocks_per_sm * sms // blocks)
    plans = []
    for splits in sorted({1, min(useful, wanted), min(useful, 2 * wanted)}):
        plan = dataclasses.replace(base, splits=splits, c_chunk=c_chunk)
        if plan.splits > 1 and (plan.splits - 1) * plan.split_channels >= plan.group_in:
            continue  # an empty split
        if plan.shared_bytes <= SHARED_BYTES:
            plans.append(plan)
    return plans


def _worth_planning(plan: RegisterTilePlan) -> bool:
    """Skip tiles much larger than the output and k-blocks that leave most of a block's warps idle."""
    (oh, ow), (th, tw) = plan.out_extent_hw, plan.tile_hw
    if (th > 2 * oh and plan.ph > 1) or (tw > 2 * ow and plan.pw > 1):
        return False
    return plan.k_block <= 2 * plan.group_out or plan.kt == 1


def candidates(geometry: ConvGeometry, weight_density: float, sms: int) -> list[RegisterTilePlan]:
    """Every feasible plan for this geometry, cheapest first by `estimate_us`."""
    return list(_ranked(geometry, round(weight_density, 4), sms))


@functools.lru_cache(maxsize=256)
def _ranked(geometry: ConvGeometry, weight_density: float, sms: int) -> tuple[RegisterTilePlan, ...]:
    return tuple(sorted(_feasible(geometry, sms), key=lambda p: estimate_us(p, weight_density, sms)))


def shortlist(geometry: ConvGeometry, weight_density: float, sms: int, count: int) -> list[RegisterTilePlan]:
    """The `count` best-predicted plans whose register tiles (layout, ph, pw, kt) differ, for timing on the
    device: plans that differ only in lane layout or splits are near-ties of the model and rarely worth a
    measurement. Where the geometry allows both layouts (1×1 kernels), the best plan of each is always in
    it (replacing the last pick of the other layout), since the model is calibrated on 2-D tiles only."""
    ranked = candidates(geometry, weight_density, sms)
    chosen: list[RegisterTilePlan] = []
    for p in ranked:
        if len(chosen) == count:
            break
        if all((p.pixel_run, p.ph, p.pw, p.kt) != (c.pixel_run, c.ph, c.pw, c.kt) for c in chosen):
            chosen.append(p)
    for layout in (False, True):
        best = next((p for p in ranked if p.pixel_run == layout), None)
        if best is not None and count >= 2 and all(c.pixel_run != layout for c in chosen):
            others = [i for i, c in enumerate(chosen) if c.pixel_run != layout]
            chosen[others[-1]] = best
    return sorted(chosen, key=ranked.index)


def plan(geometry: ConvGeometry, weight_density: float, sms: int) -> RegisterTilePlan:
    """The plan `estimate_us` predicts fastest; raises if the kernel does not support the geometry."""
    reason = unsupported_reason(geometry)
    if reason is not None:
        raise ValueError(f"register-tiled conv cannot run {geometry}: {reason}")
    return candidates(geometry, weight_density, sms)[0]


def estimate_us(plan: RegisterTilePlan, weight_density: float, sms: int) -> float:
    """Predicted microseconds on the GPU the constants describe: the busiest SM's issue slots or shared-memory
    wavefronts (whichever binds, slowed when too few warps hide latency), or the L2 traffic of staging
    and split partials if that takes longer, plus a launch."""
    g = plan.geometry
    instructions, wavefronts, staging_instructions = (_run_costs if plan.pixel_run else _tile_costs)(
        plan, weight_density
    )
    tiles, k_blocks, splits = plan.grid
    blocks = tiles * k_blocks * splits
    per_channel = max(
        plan.warps * (instructions + staging_instructions) / (WARP_INSTRUCTIONS_PER_CYCLE * ISSUE_EFFICIENCY),
        plan.warps * wavefronts,
    )
    blocks_on_busiest = math.ceil(blocks / sms)
    resident_warps = min(blocks_on_busiest, plan.blocks_per_sm) * plan.warps
    latency_factor = max(1.0, WARPS_TO_HIDE_LATENCY / resident_warps)
    cycles = blocks_on_busiest * plan.split_channels * per_channel * latency_factor
    out_bytes = 4 * g.out_channels * g.out_hw[0] * g.out_hw[1]
    staged_bytes = 4 * blocks * plan.split_channels * plan.in_hw[0] * plan.in_hw[1]
    split_bytes = 0 if splits == 1 else 2 * splits * out_bytes
    memory_us = (staged_bytes + split_bytes + out_bytes) / L2_BYTES_PER_US
    compute_us = MEASURED_CYCLES_PER_MODELLED * cycles / (CLOCK_GHZ * 1e3)
    stores = plan.warps * plan.kt * plan.ph * plan.pw // _store_width(plan)  # warp-wide, per block
    store_us = STORE_CYCLES_PER_SECTOR * blocks * stores * _store_sectors(plan) / sms / (CLOCK_GHZ * 1e3)
    return FIXED_US + max(compute_us, memory_us) + store_us


def _tile_costs(plan: RegisterTilePlan, weight_density: float) -> tuple[float, float, float]:
    """(warp instructions, shared-memory wavefronts per warp, staging instructions per warp) for one staged
    channel of a 2-D tile: window rows, one record per (k, row group) with its tap tests, the weights."""
    r, s = plan.geometry.kernel
    rows, width = plan.window_hw
    loaded_rows = sum(1 for q in range(rows) if first_use(plan, q) is not None)
    taps = r * s * weight_density * plan.kt  # nonzero weights a warp meets per channel
    groups, group_taps = plan.record_groups, plan.record_rows * s
    record_loads = groups * math.ceil(plan.kt / min(plan.kt, 4))
    instructions = (
        loaded_rows * len(row_loads(width, plan.vector))
        + record_loads
        + plan.kt * groups * (RECORD_INSTRUCTIONS + 2 * group_taps)
        + taps * (2 + plan.ph * plan.pw)
        + 8
    )
    wavefronts = loaded_rows * plan.window_row_wavefronts + record_loads + taps
    staging = plan.in_hw[0] * -(-plan.in_hw[1] // 32) * 6 / plan.warps
    return instructions, wavefronts, staging


def _run_costs(plan: RegisterTilePlan, weight_density: float) -> tuple[float, float, float]:
    """The same for a pixel run: one record per warp (a channel none of the warp's `kt` weights uses is skipped
    there), then `pw / vector` vector loads, a bit test per output channel, a broadcast load and `pw` FMAs per
    nonzero weight; staging copies 16 bytes at a time at stride 1, 4 (with an index division) when strided."""
    taps = weight_density * plan.kt
    used = 1 - (1 - weight_density) ** plan.kt  # chance that a channel has a nonzero among the warp's weights
    instructions = RECORD_INSTRUCTIONS + used * (plan.pw // plan.vector + 2 * plan.kt) + taps * (2 + plan.pw) + 4
    wavefronts = 1 + used * plan.window_row_wavefronts + taps
    strided = plan.geometry.stride != (1, 1)
    copies = -(-plan.in_hw[1] // (32 if strided else 128))
    staging = copies * (10 if strided else 6) / plan.warps
    return instructions, wavefronts, staging


def _store_width(plan: RegisterTilePlan) -> int:
    """Floats per lane of one output store: `vector` for pixel runs, 1 for 2-D tiles."""
    return plan.vector if plan.pixel_run else 1


def _store_sectors(plan: RegisterTilePlan) -> int:
    """32-byte sectors one warp-wide store of an accumulator (fixed k, i, j) touches: its active lanes
    write pixels `pw` apart along x and `ph` output rows apart along y; a pixel run's lanes write
    `32 × vector` adjacent floats."""
    if plan.pixel_run:
        return 4 * plan.vector
    return _sectors(plan.lanes_x, plan.lanes_y, plan.ph * plan.geometry.out_hw[1], plan.pw)


@functools.lru_cache(maxsize=4096)
def _sectors(lanes_x: int, lanes_y: int, row_floats: int, col_floats: int) -> int:
    return len({(y * row_floats + x * col_floats) // 8 for y in range(lanes_y) for x in range(lanes_x)})
