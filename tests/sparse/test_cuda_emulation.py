"""The CUDA convolution's exact algorithm (tiles, bands, per-kernel-row weight slices, capacities),
emulated on the CPU, against the dense convolution; and the tile planner's invariants."""

import pytest
import torch

from tendril.sparse.activations import ActivationLayout
from tendril.sparse.format import ConvGeometry
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.conv.cartesian_cuda import emulation as cuda_emulation
from tendril.sparse.ops.conv.cartesian_cuda import tiling
from tests.sparse.checks import CONV_CASES, REL_TOL, check_conv, conv_operands, poisoned, relative_error

CPU = torch.device("cpu")


def _emulated(target_blocks: int, relu: bool = False):
    def conv(acts, weights, init):
        tiled = tiling.TiledWeights.prepare(weights, tiling.plan(weights.geometry, target_blocks))
        return cuda_emulation.conv(acts, weights, tiled, init, relu=relu)

    return conv


@pytest.mark.parametrize("target_blocks", [1, 10_000])
@pytest.mark.parametrize("case", CONV_CASES)
def test_emulated_cuda_conv_matches_dense_conv(case, target_blocks):
    check_conv(case, compress_cpu.compress, _emulated(target_blocks), CPU)


def test_emulated_cuda_conv_fuses_relu_and_respects_a_reduced_capacity():
    case = CONV_CASES[0]
    weights, x, init, ref = conv_operands(case, CPU)
    layout = ActivationLayout.for_conv(weights.geometry, 0.2)
    acts = compress_cpu.compress(x, layout)
    assert acts.overflowed()
    y = _emulated(4, relu=True)(poisoned(acts), weights, init)
    assert torch.isfinite(y).all()  # never reads past the stored entries
    full = compress_cpu.compress(x, ActivationLayout.for_conv(weights.geometry))
    assert relative_error(_emulated(4, relu=True)(full, weights, init), ref.relu()) <= REL_TOL


@pytest.mark.parametrize(("k", "size"), [(64, 224), (128, 112), (512, 14), (2048, 7), (3, 5)])
def test_tile_plan_fits_shared_memory_and_covers_the_output(k, size):
    g = ConvGeometry(16, k, (3, 3), (1, 1), (1, 1), 1, (size, size))
    plan = tiling.plan(g)
    assert plan.k_block * plan.tile_h * g.out_hw[1] <= tiling.ACC_CAPACITY
    rows, blocks = plan.grid(g)
    assert rows * plan.tile_h >= g.out_hw[0] and blocks * plan.k_block >= k
    assert 32 % plan.act_lanes == 0


def test_tiled_weights_slices_hold_exactly_their_block_and_kernel_row():
    case = CONV_CASES[1]
    weights, *_ = conv_operands(case, CPU)
    plan = tiling.TilePlan(tile_h=2, k_block=2, act_lanes=32)
    tiled = tiling.TiledWeights.prepare(weights, plan)
    taps = tiled.taps.long()
    for v in range(weights.geometry.virtual_channels):
        for segment in range(tiled.n_blocks * tiled.kernel_h):
            lo, hi = int(tiled.row_ptr[v, segment]), int(tiled.row_ptr[v, segment + 1])
            assert bool((((taps[lo:hi] >> 16) // 2) == segment // tiled.kernel_h).all())
            assert bool((((taps[lo:hi] >> 8) & 0xFF) == segment % tiled.kernel_h).all())
    assert int(tiled.row_ptr[-1, -1]) == weights.nnz
