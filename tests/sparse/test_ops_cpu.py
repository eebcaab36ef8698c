"""The CPU implementations of compression, convolution and the FC layer against their references."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tendril.sparse.format import ActivationLayout
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.compress import reference as compress_reference
from tendril.sparse.ops.conv import cpu as conv_cpu
from tendril.sparse.ops.conv import reference as conv_reference
from tendril.sparse.ops.linear import cpu as linear_cpu
from tendril.sparse.ops.linear import reference as linear_reference
from tests.sparse.checks import (
    CONV_CASES,
    REL_TOL,
    ConvCase,
    assert_same_compression,
    check_conv,
    check_linear,
    conv_operands,
    poisoned,
    relative_error,
    sparse_tensor,
)

CPU = torch.device("cpu")


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("method", ["cartesian", "direct", "auto"])
@pytest.mark.parametrize("case", CONV_CASES)
def test_cpu_conv_matches_dense_conv(case, method, threads):
    def conv(acts, weights, init):
        return conv_cpu.conv(acts, weights, init, threads=threads, method=method)

    check_conv(case, lambda x, layout: compress_cpu.compress(x, layout, threads=threads), conv, CPU)


@pytest.mark.parametrize("case", CONV_CASES[:3])
def test_reference_conv_matches_dense_conv(case):
    check_conv(case, compress_reference.compress, conv_reference.conv, CPU)


@settings(max_examples=40, deadline=None)
@given(
    channels=st.integers(1, 4),
    groups=st.sampled_from([1, 2]),
    size=st.tuples(st.integers(4, 14), st.integers(4, 14)),
    kernel=st.sampled_from([1, 3, 5, 7, 11]),
    stride=st.integers(1, 4),
    padding=st.integers(0, 5),
    weight_density=st.sampled_from([0.0, 0.2, 0.7, 1.0]),
    act_density=st.sampled_from([0.0, 0.05, 0.3, 1.0]),
    method=st.sampled_from(["cartesian", "direct"]),
    seed=st.integers(0, 1000),
)
def test_cpu_conv_over_random_geometries(
    channels, groups, size, kernel, stride, padding, weight_density, act_density, method, seed
):
    if min(size) + 2 * padding < kernel:
        return
    case = ConvCase(
        channels * groups, 2 * groups, size, kernel, stride, padding, groups, weight_density, act_density, seed
    )
    check_conv(case, compress_cpu.compress, lambda a, w, i: conv_cpu.conv(a, w, i, threads=2, method=method), CPU)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize(("weight_density", "act_density"), [(0.3, 0.5), (1.0, 1.0), (0.0, 0.5), (0.5, 0.0)])
def test_cpu_linear_matches_dense(weight_density, act_density, threads):
    check_linear(
        97,
        33,
        weight_density,
        act_density,
        compress_cpu.compress,
        lambda a, w, i: linear_cpu.linear(a, w, i, threads=threads),
        CPU,
    )
    check_linear(97, 33, weight_density, act_density, compress_cpu.compress, linear_reference.linear, CPU)


def test_overflowing_capacity_keeps_the_true_count_and_stores_only_what_fits():
    x = sparse_tensor((2, 6, 6), 1.0, torch.Generator().manual_seed(0), positive=True)
    layout = ActivationLayout(2, (6, 6), (1, 1), (0, 0), 10)
    acts = compress_cpu.compress(x, layout)
    assert acts.counts.tolist() == [36, 36] and acts.overflowed()
    assert_same_compression(acts, compress_reference.compress(x, layout))


def test_linear_parts_cover_every_activation_once():
    entries = torch.tensor([5, 0, 3, 9, 1, 1, 7, 0], dtype=torch.int32)
    for parts in (1, 2, 3, 8, 20):
        bounds = linear_cpu._balanced_bounds(entries, parts).tolist()
        assert bounds[0] == 0 and bounds[-1] == len(entries) and bounds == sorted(bounds)
        assert len(bounds) == parts + 1


def test_cost_model_prefers_the_cartesian_product_only_for_very_sparse_activations():
    weights, x, _, _ = conv_operands(ConvCase(8, 8, (32, 32), 3, 1, 1, 1, 0.3, 1.0), CPU)
    plan = conv_cpu.CpuConvPlan.prepare(weights)
    layout = ActivationLayout.for_conv(weights.geometry)
    dense_cost = plan.work(compress_cpu.compress(x, layout).stored_counts)
    assert dense_cost["direct"] < dense_cost["cartesian"]
    sparse_cost = plan.work(compress_cpu.compress(x * (torch.rand(x.shape) < 0.01), layout).stored_counts)
    assert sparse_cost["cartesian"] < sparse_cost["direct"]


@pytest.mark.parametrize("method", ["cartesian", "direct"])
def test_cpu_conv_handles_empty_channels_and_reuses_its_plan(method):
    weights, x, init, ref = conv_operands(ConvCase(6, 5, (12, 10), 3, 1, 1, 1, 0.6, 0.5, seed=3), CPU)
    x[::2] = 0
    ref = torch.nn.functional.conv2d(x[None].double(), weights.to_dense().double(), padding=1)[0] + init.double()
    plan = conv_cpu.CpuConvPlan.prepare(weights)
    acts = poisoned(compress_cpu.compress(x, ActivationLayout.for_conv(weights.geometry)))
    original_init = init.clone()
    for _ in range(2):
        y = conv_cpu.conv(acts, weights, init, plan=plan, method=method)
        assert relative_error(y, ref) <= REL_TOL
    assert torch.equal(init, original_init)


def test_cpu_conv_rejects_a_foreign_plan_and_unknown_methods():
    weights, x, init, _ = conv_operands(CONV_CASES[0], CPU)
    other, _, _, _ = conv_operands(CONV_CASES[0], CPU)
    acts = compress_cpu.compress(x, ActivationLayout.for_conv(weights.geometry))
    with pytest.raises(ValueError, match="prepared for other weights"):
        conv_cpu.conv(acts, weights, init, plan=conv_cpu.CpuConvPlan.prepare(other))
    with pytest.raises(ValueError, match="expected one of"):
        conv_cpu.conv(acts, weights, init, method="dense")
