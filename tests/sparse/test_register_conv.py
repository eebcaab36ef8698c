"""The register-tiled sparse-weight convolution on the CPU: its exact algorithm (tiles, halos,
channel chunks and splits, row records, ticketed split reduction, fused epilogue, nonzero counts)
emulated against the dense convolution; the weight layout and planner invariants; and the CUDA
source compiled with NVRTC for sm_90 when the NVRTC library loads here (no GPU needed)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.ops.conv import register_emulation, register_tiling
from tendril.sparse.ops.conv.register_tiling import RegisterTilePlan, RowMaskWeights
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
        lanes_x=rng.choice([4, 8]),
        splits=rng.randint(1, min(3, group_in)),
        c_chunk=rng.randint(1, 2),
        warps=2,
    )
    assert plan.shared_bytes <= register_tiling.SHARED_BYTES
    return plan


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


@pytest.mark.parametrize("case", CONV_CASES + random_cases(24, seed=3))
def test_emulated_register_conv_with_the_planned_tiles_matches_dense_conv(case):
    run_case(case, lambda g, d: register_tiling.plan(g, d, 132), relu=False, residual=False, seed=0)


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


def test_row_records_decode_to_the_dense_weights():
    case = ConvCase(6, 10, (9, 9), 5, 2, 2, 2, 0.4, 0.5)
    weights, *_ = conv_operands(case, CPU)
    g = weights.geometry
    plan = RegisterTilePlan(g, 2, 2, 2, 8, 1, 2, warps=2)
    packed = RowMaskWeights.prepare(weights, plan)
    (r, s), dense = g.kernel, weights.to_dense()
    decoded = torch.zeros(plan.k_blocks * plan.k_block, plan.group_in, r, s)
    for kb in range(plan.k_blocks):
        for c in range(plan.group_in):
            start = int(packed.chan_ptr[kb, c])
            for k in range(plan.k_block):
                for row in range(r):
                    record = int(packed.records[kb, c, k, row])
                    taps = [t for t in range(s) if record >> t & 1]
                    values = packed.values[start + (record >> 16) : start + (record >> 16) + len(taps)]
                    decoded[kb * plan.k_block + k, c, row, taps] = values
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
    plan = register_tiling.plan(g, 0.3, 132)
    assert plan.shared_bytes <= register_tiling.SHARED_BYTES
    assert plan.kt * plan.ph * plan.pw <= register_tiling.MAX_ACCUMULATORS
    assert plan.ph * plan.patch_w <= register_tiling.MAX_PATCH_FLOATS
    tiles_y, tiles_x = plan.tiles
    assert tiles_y * plan.tile_hw[0] >= g.out_hw[0] and tiles_x * plan.tile_hw[1] >= g.out_hw[1]
    assert plan.k_blocks * plan.k_block >= out_channels and plan.split_channels * plan.splits >= channels
    assert (
        plan.grid[0] * plan.grid[1] * plan.grid[2] >= 132
        or plan.splits == register_tiling.MAX_SPLITS
        or (plan.split_channels <= 2 * register_tiling.MIN_CHANNELS_PER_SPLIT)
    )


def test_wide_kernels_are_reported_unsupported():
    g = ConvGeometry(4, 4, (3, 17), (1, 1), (1, 8), 1, (20, 40))
    assert "tap bits" in (register_tiling.unsupported_reason(g) or "")
    with pytest.raises(ValueError, match="tap bits"):
        register_tiling.plan(g, 0.5, 132)


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
        ConvGeometry(64, 64, (3, 3), (1, 1), (1, 1), 1, (224, 224)),  # vector loads, 4 channels per warp
        ConvGeometry(512, 512, (3, 3), (1, 1), (1, 1), 1, (14, 14)),  # channel splits
        ConvGeometry(3, 64, (11, 11), (4, 4), (2, 2), 1, (224, 224)),  # AlexNet's first layer
        ConvGeometry(8, 8, (5, 5), (2, 2), (2, 2), 2, (30, 30)),  # groups, stride 2
    ],
)
def test_cuda_source_compiles_for_sm90_without_spills(geometry):
    from tendril.sparse.ops.conv import register_cuda

    plan = register_tiling.plan(geometry, 0.3, 132)
    cubin, log = register_cuda.compile_for(plan, "sm_90", ("-Xptxas=-v",))
    assert cubin
    assert "0 bytes spill stores" in log, log
