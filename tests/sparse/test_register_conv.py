"""The register-tiled sparse-weight convolution on the CPU: its exact algorithm (tiles, halos,
channel chunks and splits, row-group records, ticketed split reduction, fused epilogue, nonzero
counts) emulated against the dense convolution, for 2-D tiles and for the pixel runs of 1×1
convolutions; the weight layouts, the bank-conflict model and planner invariants; and the CUDA
source of both layouts compiled with NVRTC for sm_90 when the NVRTC library loads here (no GPU
needed): no spills, no local memory."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.ops.conv.register import emulation as register_emulation
from tendril.sparse.ops.conv.register import planner as register_planner
from tendril.sparse.ops.conv.register import tiling as register_tiling
from tendril.sparse.ops.conv.register.tiling import RegisterTilePlan, RowMaskWeights
from tests.sparse.checks import CONV_CASES, REL_TOL, ConvCase, conv_operands, relative_error, sparse_tensor

CPU = torch.device("cpu")


def random_cases(n: int, seed: int) -> list[ConvCase]:
    """Small random geometries: kernels 1/3/5/7/11, strides 1-4, paddings, groups, densities 0 and 1."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        groups = rng.choice([1, 1, 2, 3])
        kernel = rng.choice([1, 3, 5, 7, 11])
        padding = rng.randint(0, kernel // 2 + 1)
        size = (rng.randint(max(1, kernel - 2 * padding), 19), rng.randint(max(1, kernel - 2 * padding), 37))
        cases.append(
            ConvCase(
                groups * rng.randint(1, 5),
                groups * rng.randint(1, 9),
                size,
                kernel,
                rng.randint(1, 4),
                padding,
                groups,
                rng.choice([0.0, 0.3, 0.6, 1.0]),
                rng.choice([0.0, 0.1, 0.5, 1.0]),
                seed=rng.randint(0, 999),
            )
        )
    return cases


def small_plan(g: ConvGeometry, rng: random.Random) -> RegisterTilePlan:
    """A deliberately small plan (2 warps, small tiles, 1-2 channel chunks, splits) so that tiny shapes
    still span several tiles, k-blocks, chunks and splits."""
    group_in = g.in_channels // g.groups
    plan = RegisterTilePlan(
        g,
        ph=rng.choice([1, 2]),
        pw=rng.choice([1, 2, 4]),
        kt=rng.choice([1, 2]),
        lanes_x=rng.choice([4, 8, 3, 7]),  # 3 and 7 leave idle lanes
        splits=rng.randint(1, min(3, group_in)),
        c_chunk=rng.randint(1, 2),
        warps=2,
    )
    assert plan.shared_bytes <= register_tiling.SHARED_BYTES
    return plan


def random_run_cases(n: int, seed: int) -> list[ConvCase]:
    """Small random 1×1 geometries without padding (pixel runs): strides 1 and 2, odd sizes, groups,
    weight densities 0, 0.2 and 1."""
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        groups = rng.choice([1, 1, 1, 2])
        cases.append(
            ConvCase(
                groups * rng.randint(1, 11),
                groups * rng.randint(1, 13),
                (rng.randint(1, 15), rng.randint(1, 19)),
                1,
                rng.choice([1, 2]),
                0,
                groups,
                rng.choice([0.0, 0.2, 0.2, 1.0]),
                rng.choice([0.0, 0.5, 1.0]),
                seed=rng.randint(0, 999),
            )
        )
    return cases


def small_run_plan(g: ConvGeometry, rng: random.Random) -> RegisterTilePlan:
    """A deliberately small pixel-run plan (1-2 warps, runs of 32-384 pixels, vectors of 1, 2 and 4, 1-3
    channel chunks, splits) so that tiny shapes still span several runs, k-blocks, chunks and splits."""
    group_in = g.in_channels // g.groups
    plan = RegisterTilePlan(
        g,
        ph=1,
        pw=rng.choice(register_tiling.PIXEL_RUN_PW[:5]),
        kt=rng.choice([1, 2, 4]),
        lanes_x=32,
        splits=rng.randint(1, min(3, group_in)),
        c_chunk=rng.randint(1, 3),
        warps=rng.choice([1, 2]),
        pixel_run=True,
    )
    assert plan.shared_bytes <= register_tiling.SHARED_BYTES
    return plan


RUN_CASES = random_run_cases(24, seed=21)
SMALL_RUN_CASES = random_run_cases(24, seed=23)


def run_case(case: ConvCase, plan_for, *, relu: bool, residual: bool, seed: int) -> None:
    weights, x, init, ref = conv_operands(case, CPU)
    g = weights.geometry
    bias = init[:, 0, 0].clone()
    resid = None
    if residual:
        resid = torch.randn(g.out_channels, *g.out_hw, generator=torch.Generator().manual_seed(seed))
        ref = ref + resid.double()
    if relu:
        ref = ref.relu()
    plan = plan_for(g, weights.density)
    if case.kernel == 1 and case.padding == 0 and plan_for is planned:
        assert plan.pixel_run, "the planner should pick a pixel run for a 1×1 convolution"
    packed = RowMaskWeights.prepare(weights, plan)
    y, counts = register_emulation.conv(
        x, packed, bias, residual=resid, relu=relu, block_order=torch.Generator().manual_seed(seed)
    )
    assert not y.isnan().any(), "an output was never written"
    if ref.abs().max() == 0:
        assert torch.equal(y, torch.zeros_like(y))
    else:
        assert relative_error(y, ref) <= REL_TOL, (case, plan)
    assert int(counts.sum()) == int((x != 0).sum()), "tile counts must partition the input plane"


def planned(g: ConvGeometry, density: float) -> RegisterTilePlan:
    return register_planner.plan(g, density, 132)


@pytest.mark.parametrize("case", CONV_CASES + random_cases(24, seed=3))
def test_emulated_register_conv_with_the_planned_tiles_matches_dense_conv(case):
    run_case(case, planned, relu=False, residual=False, seed=0)


@pytest.mark.parametrize("case", RUN_CASES)
def test_emulated_pixel_run_conv_with_the_planned_runs_matches_dense_conv(case):
    run_case(case, planned, relu=True, residual=True, seed=case.seed)


@pytest.mark.parametrize("index", range(len(SMALL_RUN_CASES)))
def test_emulated_pixel_run_conv_with_small_runs_splits_and_fused_epilogue(index):
    rng = random.Random(index)
    run_case(
        SMALL_RUN_CASES[index],
        lambda g, d: small_run_plan(g, rng),
        relu=rng.random() < 0.5,
        residual=rng.random() < 0.5,
        seed=index,
    )


@pytest.mark.parametrize("index", range(24))
def test_emulated_register_conv_with_small_tiles_splits_and_fused_epilogue(index):
    case = random_cases(24, seed=11)[index]
    rng = random.Random(index)
    run_case(
        case,
        lambda g, d: small_plan(g, rng),
        relu=rng.random() < 0.5,
        residual=rng.random() < 0.5,
        seed=index,
    )


@pytest.mark.parametrize(
    ("case", "record_rows"),
    [(ConvCase(6, 10, (9, 9), 5, 2, 2, 2, 0.4, 0.5), 1), (ConvCase(4, 7, (6, 6), 3, 1, 1, 1, 0.5, 0.5), 3)],
)
def test_records_decode_to_the_dense_weights(case, record_rows):
    weights, *_ = conv_operands(case, CPU)
    g = weights.geometry
    plan = RegisterTilePlan(g, 2, 2, 2, 8, 1, 2, warps=2)
    assert plan.record_rows == record_rows  # 5×5: a record per kernel row; 3×3: one for all 9 taps
    packed = RowMaskWeights.prepare(weights, plan)
    (r, s), dense = g.kernel, weights.to_dense()
    decoded = torch.zeros(plan.k_blocks * plan.k_block, plan.group_in, r, s)
    for kb in range(plan.k_blocks):
        for c in range(plan.group_in):
            start = int(packed.chan_ptr[kb, c])
            for group in range(plan.record_groups):
                for k in range(plan.k_block):
                    record = int(packed.records[kb, c, group, k])
                    taps = [t for t in range(record_rows * s) if record >> t & 1]
                    values = packed.values[start + (record >> 16) : start + (record >> 16) + len(taps)]
                    for tap, value in zip(taps, values, strict=True):
                        decoded[kb * plan.k_block + k, c, group * record_rows + tap // s, tap % s] = value
    k = torch.arange(g.out_channels)
    group, local = k // plan.group_out, k % plan.group_out
    blocked_index = (group * plan.k_blocks_per_group * plan.k_block + local).long()
    assert torch.equal(decoded[blocked_index], dense)
    assert packed.values.numel() == weights.nnz


@pytest.mark.parametrize(
    ("channels", "out_channels", "size", "kernel", "stride", "padding"),
    [
        (3, 64, 224, 3, 1, 1),
        (64, 64, 224, 3, 1, 1),
        (256, 256, 56, 3, 1, 1),
        (512, 512, 28, 3, 1, 1),
        (512, 512, 14, 3, 1, 1),
        (3, 64, 224, 11, 4, 2),
        (3, 64, 224, 7, 2, 3),
        (1024, 512, 14, 1, 2, 0),
        (2048, 512, 7, 1, 1, 0),
    ],
)
def test_planner_fits_limits_and_fills_the_gpu(channels, out_channels, size, kernel, stride, padding):
    g = ConvGeometry(channels, out_channels, (kernel, kernel), (stride, stride), (padding, padding), 1, (size, size))
    plan = register_planner.plan(g, 0.3, 132)
    assert plan.shared_bytes <= register_tiling.SHARED_BYTES
    assert plan.registers <= register_tiling.MAX_REGISTERS
    assert plan.pitch >= plan.in_hw[1] and plan.pitch % plan.vector == 0
    assert plan.active_lanes >= 28
    assert plan.pixel_run == (kernel == 1)
    (tiles_y, tiles_x), (extent_h, extent_w) = plan.tiles, plan.out_extent_hw
    assert tiles_y * plan.tile_hw[0] >= extent_h and tiles_x * plan.tile_hw[1] >= extent_w
    assert extent_h * extent_w == g.out_hw[0] * g.out_hw[1]
    assert plan.k_blocks * plan.k_block >= out_channels and plan.split_channels * plan.splits >= channels
    assert (
        plan.grid[0] * plan.grid[1] * plan.grid[2] >= 132
        or plan.splits == register_tiling.MAX_SPLITS
        or (plan.split_channels <= 2 * register_tiling.MIN_CHANNELS_PER_SPLIT)
    )


@pytest.mark.parametrize("kt", [1, 4, 16])
def test_pixel_run_records_decode_to_the_dense_weights(kt):
    case = ConvCase(6, 37, (5, 7), 1, 2, 0, 1, 0.3, 0.5)
    weights, *_ = conv_operands(case, CPU)
    plan = RegisterTilePlan(weights.geometry, 1, 2, kt, 32, 1, 2, warps=2, pixel_run=True)
    packed = RowMaskWeights.prepare(weights, plan)
    assert tuple(packed.records.shape) == (plan.k_blocks, 6, 1, 2)
    decoded = torch.zeros(plan.k_blocks * plan.k_block, 6)
    for kb in range(plan.k_blocks):
        for c in range(6):
            start = int(packed.chan_ptr[kb, c])
            for warp in range(plan.warps):
                record = int(packed.records[kb, c, 0, warp])
                channels = [kk for kk in range(kt) if record >> kk & 1]
                assert record & 0xFFFF < 1 << kt
                values = packed.values[start + (record >> 16) : start + (record >> 16) + len(channels)]
                for kk, value in zip(channels, values, strict=True):
                    decoded[kb * plan.k_block + warp * kt + kk, c] = value
    assert torch.equal(decoded[:37], weights.to_dense()[:, :, 0, 0])
    assert not decoded[37:].any() and packed.values.numel() == weights.nnz


def test_pixel_run_plans_are_only_made_for_unpadded_1x1_kernels():
    padded = ConvGeometry(4, 4, (1, 1), (1, 1), (1, 1), 1, (8, 8))
    three = ConvGeometry(4, 4, (3, 3), (1, 1), (1, 1), 1, (8, 8))
    for g in (padded, three):
        assert not any(p.pixel_run for p in register_planner.candidates(g, 0.3, 132))
        with pytest.raises(ValueError, match="1×1 kernel without padding"):
            RegisterTilePlan(g, 1, 4, 2, 32, 1, 1, pixel_run=True)
    g = ConvGeometry(4, 4, (1, 1), (2, 2), (0, 0), 1, (9, 9))
    with pytest.raises(ValueError, match="lanes_x 32"):
        RegisterTilePlan(g, 1, 4, 2, 8, 1, 1, pixel_run=True)
    with pytest.raises(ValueError, match="pw in"):
        RegisterTilePlan(g, 1, 6, 2, 32, 1, 1, pixel_run=True)


@pytest.mark.parametrize(("channels", "out_channels", "size", "stride"), [(256, 64, 56, 1), (1024, 2048, 14, 2)])
def test_shortlist_of_a_1x1_layer_times_both_layouts(channels, out_channels, size, stride):
    g = ConvGeometry(channels, out_channels, (1, 1), (stride, stride), (0, 0), 1, (size, size))
    shortlist = register_planner.shortlist(g, 0.2, 132, 3)
    assert len(shortlist) == 3 and {p.pixel_run for p in shortlist} == {True, False}
    assert shortlist[0] == register_planner.plan(g, 0.2, 132)
    costs = [register_planner.estimate_us(p, 0.2, 132) for p in shortlist]
    assert costs == sorted(costs)


def test_wide_kernels_are_reported_unsupported():
    g = ConvGeometry(4, 4, (3, 17), (1, 1), (1, 8), 1, (20, 40))
    assert "tap bits" in (register_planner.unsupported_reason(g) or "")
    assert register_planner.unsupported_reason(ConvGeometry(4, 4, (5, 16), (1, 1), (2, 8), 1, (20, 40))) is None
    with pytest.raises(ValueError, match="tap bits"):
        register_planner.plan(g, 0.5, 132)


def test_emulation_reads_no_stale_workspace_when_split_ranges_are_uneven():
    # 5 channels in 3 splits of 2: the last split holds one channel; every partial must be written.
    g = ConvGeometry(5, 3, (3, 3), (1, 1), (1, 1), 1, (6, 7))
    gen = torch.Generator().manual_seed(0)
    weight = sparse_tensor((3, 5, 3, 3), 0.5, gen)
    x = sparse_tensor((5, 6, 7), 0.5, gen, positive=True)
    weights = SparseConvWeights.from_dense(weight, g)
    plan = RegisterTilePlan(g, 1, 2, 1, 4, 3, 1, warps=2)
    y, _ = register_emulation.conv(x, RowMaskWeights.prepare(weights, plan), torch.zeros(3))
    assert relative_error(y, F.conv2d(x[None].double(), weight.double(), padding=1)[0]) <= REL_TOL


@pytest.mark.parametrize(
    ("pattern", "floats", "wavefronts"),
    [
        ((8, 4, 1024, 4), 4, 4),  # float4 per lane, 8 lanes a row: each quarter warp reads 32 adjacent words
        ((8, 4, 1040, 4), 1, 4),  # scalar, lanes 4 words apart, rows 16 banks apart: 8 banks, 4 words each
        ((16, 2, 1032, 2), 2, 2),  # float2, 16 lanes 2 words apart: each half warp reads 32 adjacent words
        ((28, 1, 1024, 2), 2, 2),  # 4 idle lanes read what lane 27 reads: broadcast, no conflict
        ((4, 8, 1040, 4), 4, 4),  # float4, 4 lanes a row, the next lane row 16 banks on: conflict-free
        ((4, 8, 1024, 4), 4, 8),  # float4, 4 lanes a row, lane rows in the same banks: 2-way conflict
    ],
)
def test_bank_model_counts_wavefronts(pattern, floats, wavefronts):
    assert register_tiling._wavefronts(pattern, floats) == wavefronts


def test_pitch_avoids_the_conflicts_that_a_packed_row_would_have():
    g = ConvGeometry(8, 8, (3, 3), (1, 1), (1, 1), 1, (32, 32))
    plan = RegisterTilePlan(g, 1, 1, 1, 8, 1, 4)  # 4 lane rows of 8 lanes, 3 scalar loads per window row
    assert plan.in_hw[1] == 10 and plan.vector == 1
    packed_row = 3 * register_tiling._wavefronts((8, 4, 10 + 1024, 1), 1)  # pitch 10: lane rows 0 and 3 collide
    assert packed_row == 6
    assert plan.pitch % 32 in (8, 24) and plan.window_row_wavefronts == 3  # lane rows in disjoint banks


@pytest.mark.parametrize(
    ("kernel", "stride", "ph", "peak_rows"),
    [(3, 1, 4, 6), (3, 1, 1, 3), (11, 4, 1, 1), (7, 2, 2, 3), (1, 2, 4, 4)],
)
def test_window_rows_are_loaded_at_first_use_and_the_live_window_is_bounded(kernel, stride, ph, peak_rows):
    pad = kernel // 2
    g = ConvGeometry(4, 4, (kernel, kernel), (stride, stride), (pad, pad), 1, (40, 40))
    plan = RegisterTilePlan(g, ph, 2, 1, 8, 1, 1)
    rows, width = plan.window_hw
    used = [q for q in range(rows) if register_tiling.first_use(plan, q) is not None]
    assert used == [q for q in range(rows) if any(0 <= q - i * stride < kernel for i in range(ph))]
    assert register_tiling._peak_window_floats(plan) == peak_rows * width


def _nvrtc_available() -> bool:
    try:
        from tendril.cuda.nvrtc import nvrtc_version

        nvrtc_version()
    except Exception:  # the NVRTC shared library is not installed or does not load here
        return False
    return True


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC library not loadable on this machine")
@pytest.mark.parametrize(
    "geometry",
    [
        ConvGeometry(64, 64, (3, 3), (1, 1), (1, 1), 1, (224, 224)),  # VGG-16 conv1_2
        ConvGeometry(256, 256, (3, 3), (1, 1), (1, 1), 1, (56, 56)),  # VGG-16 conv3_2
        ConvGeometry(512, 512, (3, 3), (1, 1), (1, 1), 1, (14, 14)),  # channel splits
        ConvGeometry(3, 64, (11, 11), (4, 4), (2, 2), 1, (224, 224)),  # AlexNet's first layer: row records
        ConvGeometry(3, 64, (7, 7), (2, 2), (3, 3), 1, (224, 224)),  # ResNet's first layer
        ConvGeometry(1024, 512, (1, 1), (2, 2), (0, 0), 1, (14, 14)),  # ResNet's strided 1×1 downsample
        ConvGeometry(8, 8, (5, 5), (2, 2), (2, 2), 2, (30, 30)),  # groups, stride 2
        ConvGeometry(256, 64, (1, 1), (1, 1), (0, 0), 1, (56, 56)),  # ResNet-50 bottleneck reduce: pixel run
        ConvGeometry(512, 2048, (1, 1), (1, 1), (0, 0), 1, (7, 7)),  # bottleneck expand, 49 pixels
        RegisterTilePlan(ConvGeometry(9, 9, (1, 1), (2, 2), (0, 0), 1, (9, 9)), 1, 1, 2, 32, 2, 3, 2, pixel_run=True),
        RegisterTilePlan(ConvGeometry(9, 9, (1, 1), (1, 1), (0, 0), 1, (9, 9)), 1, 2, 4, 32, 1, 3, 2, pixel_run=True),
        RegisterTilePlan(ConvGeometry(9, 9, (1, 1), (1, 1), (0, 0), 1, (9, 9)), 1, 12, 16, 32, 1, 3, 4, pixel_run=True),
    ],
)
def test_cuda_source_compiles_for_sm90_without_spills_or_local_memory(geometry):
    from tendril.sparse.ops.conv.register import kernel as register_cuda

    plan = geometry if isinstance(geometry, RegisterTilePlan) else register_planner.plan(geometry, 0.3, 132)
    cubin, log = register_cuda.compile_for(plan, "sm_90", ("-Xptxas=-v",))
    assert cubin
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in log, log
    used = int(log.split("Used ")[1].split(" registers")[0])
    assert used * plan.warps * 32 * plan.blocks_per_sm <= register_tiling.SM_REGISTERS, log


@pytest.mark.skipif(not _nvrtc_available(), reason="NVRTC library not loadable on this machine")
def test_precompile_fills_the_disk_cache_from_worker_processes(tmp_path, monkeypatch):
    from tendril.sparse.ops.conv.register import kernel as register_cuda

    monkeypatch.setenv("TENDRIL_CACHE_DIR", str(tmp_path))  # the spawned workers read it at import
    g = ConvGeometry(16, 16, (3, 3), (1, 1), (1, 1), 1, (12, 12))
    plans = [RegisterTilePlan(g, 1, 2, 1, 8, 1, 2, warps=2), RegisterTilePlan(g, 2, 2, 1, 8, 1, 2, warps=2)]
    assert register_cuda.precompile(plans + plans[:1], workers=2, capability=(9, 0)) == 2
    assert len(list((tmp_path / "nvrtc").glob("sparse_weight_conv-*.cubin"))) == 2


def test_store_sectors_count_the_lanes_output_footprint() -> None:
    # 8 lanes storing adjacent floats: one 32-byte sector per lane row; 4 lanes 4 floats apart: two per row
    assert register_planner._sectors(8, 4, 64, 1) == 4
    assert register_planner._sectors(4, 8, 4 * 64, 4) == 16


# (ph, pw, kt, lanes_x, warps, splits, c_chunk) of plans measured on an H200 (benchmarks/results/
# sparse-conv-kernels.json), faster first, each pair more than 15% apart on one VGG-16 layer.
MEASURED_ORDER = [
    ((512, 512, 28, 0.27), (8, 2, 2, 14, 8, 10, 8), (4, 4, 2, 4, 8, 10, 6)),  # 0.179 vs 0.225 ms
    ((256, 512, 28, 0.32), (8, 2, 2, 14, 8, 10, 8), (4, 4, 4, 7, 4, 14, 7)),  # 0.113 vs 0.170 ms
    ((64, 64, 224, 0.22), (4, 4, 2, 4, 8, 1, 6), (4, 4, 2, 4, 8, 2, 6)),  # 0.174 vs 0.213 ms
    ((3, 64, 224, 0.58), (4, 4, 2, 4, 8, 1, 3), (2, 8, 2, 2, 8, 1, 3)),  # 0.032 vs 0.047 ms
]


@pytest.mark.parametrize(("layer", "faster", "slower"), MEASURED_ORDER)
def test_cost_model_orders_plans_as_the_h200_measured(layer, faster, slower) -> None:
    c, k, size, density = layer
    g = ConvGeometry(c, k, (3, 3), (1, 1), (1, 1), 1, (size, size))
    fast, slow = (
        register_tiling.RegisterTilePlan(g, ph, pw, kt, lx, sp, cc, w) for ph, pw, kt, lx, w, sp, cc in (faster, slower)
    )
    assert register_planner.estimate_us(fast, density, 132) < register_planner.estimate_us(slow, density, 132)


def test_shortlist_offers_distinct_register_tiles_best_first() -> None:
    g = ConvGeometry(256, 256, (3, 3), (1, 1), (1, 1), 1, (56, 56))
    shortlist = register_planner.shortlist(g, 0.3, 132, 3)
    assert shortlist[0] == register_planner.plan(g, 0.3, 132)
    assert len({(p.ph, p.pw, p.kt) for p in shortlist}) == len(shortlist) == 3
    costs = [register_planner.estimate_us(p, 0.3, 132) for p in shortlist]
    assert costs == sorted(costs)
