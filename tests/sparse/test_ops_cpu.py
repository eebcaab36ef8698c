"""The CPU implementations of compression, convolution and the FC layer against their references."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tendril.sparse.activations import ActivationLayout
from tendril.sparse.format import SparseLinearWeights
from tendril.sparse.ops import cpu_pool
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.compress import reference as compress_reference
from tendril.sparse.ops.conv import reference as conv_reference
from tendril.sparse.ops.conv.cpu import direct_call
from tendril.sparse.ops.conv.cpu import kernel as conv_cpu
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


def _check_dense_input_conv(case: ConvCase, method: str, threads: int, fused: bool, count: bool = True) -> None:
    """`conv_dense_input` (what a CPU network runs) against F.conv2d + bias (+ residual, ReLU), with the
    output and the plan's planes poisoned so that a slot left unwritten shows up as NaN; with `count=False`,
    only 1×1 layers may skip counting (the others count on the way)."""
    weights, x, init, ref = conv_operands(case, CPU)
    g = weights.geometry
    bias = init[:, 0, 0].clone()
    residual = torch.randn(g.out_channels, *g.out_hw, generator=torch.Generator().manual_seed(case.seed + 1))
    if fused:
        ref = (ref + residual.double()).relu()
    plan = conv_cpu.CpuConvPlan.prepare(weights)
    layout = ActivationLayout.for_conv(g)
    for _ in range(2):
        plan.planes.fill_(float("nan"))
        out = torch.full((g.out_channels, *g.out_hw), float("nan"))
        counts = conv_cpu.conv_dense_input(
            x, plan, bias, out=out, layout=layout, residual=residual if fused else None, relu=fused,
            threads=threads, method=method, count=count,
        )  # fmt: skip
        if count or counts is not None:
            assert counts is not None
            assert torch.equal(counts.long(), compress_reference.compress(x, layout).counts.long())
        else:
            assert plan.csr is not None or plan.reads_input
        if ref.abs().max() == 0:
            assert torch.equal(out, torch.zeros_like(out))
        else:
            assert relative_error(out, ref) <= REL_TOL, (case, method, threads, fused)


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("method", ["cartesian", "direct", "auto"])
@pytest.mark.parametrize("case", CONV_CASES)
def test_cpu_conv_from_dense_input_matches_dense_conv(case, method, threads):
    _check_dense_input_conv(case, method, threads, fused=threads == 3)


@settings(max_examples=30, deadline=None)
@given(
    channels=st.integers(1, 5),
    out_channels=st.integers(1, 9),
    size=st.tuples(st.integers(3, 40), st.integers(3, 40)),
    kernel=st.sampled_from([1, 3, 5, 7, 11]),
    stride=st.integers(1, 4),
    padding=st.integers(0, 5),
    weight_density=st.sampled_from([0.0, 0.2, 0.7, 1.0]),
    act_density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    method=st.sampled_from(["cartesian", "direct"]),
    threads=st.sampled_from([1, 2, 5]),
    fused=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_cpu_conv_from_dense_input_over_random_geometries(
    channels, out_channels, size, kernel, stride, padding, weight_density, act_density, method, threads, fused, seed
):
    if min(size) + 2 * padding < kernel:
        return
    case = ConvCase(channels, out_channels, size, kernel, stride, padding, 1, weight_density, act_density, seed)
    _check_dense_input_conv(case, method, threads, fused)


@pytest.mark.parametrize("threads", [1, 3])
def test_direct_conv_reads_the_input_itself_for_unpadded_pointwise_layers(threads):
    """A 1×1 stride-1 layer without padding has no planes: the kernel reads the input (from dense and from
    compressed activations), and its counts come from a separate pass."""
    case = ConvCase(5, 9, (11, 7), 1, 1, 0, 1, 0.5, 0.5, seed=9)
    weights, _, _, _ = conv_operands(case, CPU)
    assert conv_cpu.CpuConvPlan.prepare(weights).reads_input
    for method in ("direct", "auto"):
        _check_dense_input_conv(case, method, threads, fused=threads == 3)
    check_conv(case, compress_cpu.compress, lambda a, w, i: conv_cpu.conv(a, w, i, threads=threads), CPU)


SPMM_CASES = [
    ConvCase(6, 5, (9, 11), 1, 1, 0, 1, 0.4, 0.5),
    ConvCase(7, 9, (13, 12), 1, 1, 0, 1, 0.3, 0.6),
    ConvCase(3, 4, (6, 5), 1, 1, 0, 1, 0.0, 0.5),
    ConvCase(3, 4, (6, 5), 1, 1, 0, 1, 0.5, 0.0),
    ConvCase(7, 9, (13, 12), 1, 2, 0, 1, 0.3, 0.6),
    ConvCase(4, 6, (10, 9), 1, 3, 0, 1, 0.5, 0.5),
]


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("method", ["spmm", "auto"])
@pytest.mark.parametrize("case", SPMM_CASES)
def test_spmm_conv_matches_dense_conv(case, method, threads):
    """The sparse-BLAS product of 1×1 layers, from compressed and from dense inputs (with its nonzero counts)."""
    check_conv(case, compress_cpu.compress, lambda a, w, i: conv_cpu.conv(a, w, i, threads=threads, method=method), CPU)
    _check_dense_input_conv(case, method, threads, fused=threads == 3)
    _check_dense_input_conv(case, method, threads, fused=threads == 1, count=False)


def test_auto_runs_spmm_exactly_where_it_is_supported():
    padded = ConvCase(7, 9, (13, 12), 1, 2, 1, 1, 0.3, 0.6)
    for case, supported in [(SPMM_CASES[-1], True), (CONV_CASES[0], False), (CONV_CASES[3], False), (padded, False)]:
        weights, _, _, _ = conv_operands(case, CPU)
        plan = conv_cpu.CpuConvPlan.prepare(weights)
        assert (plan.csr is not None) == supported
        if not supported:
            with pytest.raises(ValueError, match="only 1×1 convolutions"):
                conv_cpu.conv_dense_input(
                    torch.zeros(case.channels, *case.size), plan, torch.zeros(case.out_channels),
                    out=torch.empty(case.out_channels, *weights.geometry.out_hw),
                    layout=ActivationLayout.for_conv(weights.geometry), method="spmm",
                )  # fmt: skip


def test_direct_conv_splits_work_into_balanced_units_on_a_tall_layer():
    """More output rows than one band and more threads than bands: every (band, channel block) unit is
    computed exactly once."""
    _check_dense_input_conv(ConvCase(3, 17, (150, 6), 3, 1, 1, 1, 0.5, 0.5, seed=7), "direct", 7, fused=True)
    _check_dense_input_conv(ConvCase(3, 17, (3, 3), 3, 1, 1, 1, 0.5, 0.5, seed=8), "direct", 7, fused=False)


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize(("weight_density", "act_density"), [(0.3, 0.5), (1.0, 1.0), (0.0, 0.5), (0.5, 0.0)])
def test_cpu_linear_from_dense_input_matches_dense(weight_density, act_density, relu, threads):
    gen = torch.Generator().manual_seed(threads)
    weight = sparse_tensor((300, 97), weight_density, gen)
    x = sparse_tensor((97,), act_density, gen, positive=True)
    bias = torch.randn(300, generator=gen)
    ref = weight.double() @ x.double() + bias.double()
    ref = ref.relu() if relu else ref
    weights = SparseLinearWeights.from_dense(weight)
    out = torch.full((300,), float("nan"))
    counts = linear_cpu.linear_dense_input(x, weights, bias, out=out, relu=relu, threads=threads)
    assert counts.tolist() == [int((x != 0).sum())]
    assert relative_error(out, ref) <= REL_TOL


def test_dense_input_ops_reject_wrong_shapes():
    weights, x, init, _ = conv_operands(CONV_CASES[0], CPU)
    plan = conv_cpu.CpuConvPlan.prepare(weights)
    layout = ActivationLayout.for_conv(weights.geometry)
    with pytest.raises(ValueError, match="layout expects"):
        conv_cpu.conv_dense_input(x[:, 1:], plan, init[:, 0, 0], out=torch.empty_like(init), layout=layout)
    with pytest.raises(ValueError, match="out must be"):
        conv_cpu.conv_dense_input(x, plan, init[:, 0, 0], out=torch.empty(1), layout=layout)
    linear_weights = SparseLinearWeights.from_dense(torch.ones(4, 6))
    with pytest.raises(ValueError, match="expected"):
        linear_cpu.linear_dense_input(torch.ones(5), linear_weights, torch.zeros(4), out=torch.empty(4))


@pytest.mark.parametrize(
    ("shape", "kernel", "stride", "padding"),
    [
        ((1, 3, 8, 8), 2, 2, 0),
        ((2, 2, 9, 7), 3, 2, 1),
        ((1, 2, 11, 11), 3, 2, 0),
        ((1, 1, 5, 6), (2, 3), (1, 2), (1, 1)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["compiled", "separable"])
def test_cpu_max_pool_matches_torch(shape, kernel, stride, padding, dtype) -> None:
    """The CPU networks' max pool (compiled for fp32, separable strided maxima otherwise) equals torch's, NaNs and
    negative values included."""
    x = torch.randn(shape, dtype=dtype)
    x[0, 0, 1, 1] = float("nan")
    x[-1, -1, -1, -1] = float("nan")  # on the border: inside some windows only through the padding's side
    module = torch.nn.MaxPool2d(kernel, stride, padding)
    pool = cpu_pool.pooling(module)
    assert isinstance(pool, cpu_pool.SeparableMaxPool)
    torch.testing.assert_close(pool(x), module(x), rtol=0, atol=0, equal_nan=True)
    assert pool(x).is_contiguous()


@pytest.mark.parametrize("output_size", [1, (1, 1)])
@pytest.mark.parametrize("shape", [(1, 3, 7, 7), (2, 5, 4, 6), (3, 1, 9), (1, 2048, 7, 7)])
def test_cpu_global_avg_pool_matches_torch(shape, output_size) -> None:
    """The compiled mean of each plane (fp32) is torch's within fp32 rounding; other dtypes run the module."""
    x = torch.randn(shape) + 0.5
    module = torch.nn.AdaptiveAvgPool2d(output_size)
    pool = cpu_pool.pooling(module)
    assert isinstance(pool, cpu_pool.AdaptiveAvgPool)
    y = pool(x)
    assert y.shape == module(x).shape and y.is_contiguous()
    torch.testing.assert_close(y, module(x.double()).float(), rtol=1e-6, atol=1e-6)
    assert torch.equal(pool(x[..., ::2]), pool(x[..., ::2].contiguous()))
    assert torch.equal(pool(x.double()), module(x.double()))


def test_pooling_keeps_modules_it_does_not_cover() -> None:
    for module in (
        torch.nn.MaxPool2d(2, ceil_mode=True),
        torch.nn.MaxPool2d(3, dilation=2),
        torch.nn.AvgPool2d(2),
    ):
        assert cpu_pool.pooling(module) is module


@pytest.mark.parametrize("output_size", [7, (7, 7), (None, 7), (7, None)])
def test_cpu_adaptive_avg_pool_to_the_input_size_is_a_copy(output_size) -> None:
    x = torch.randn(1, 8, 7, 7)
    module = torch.nn.AdaptiveAvgPool2d(output_size)
    y = cpu_pool.pooling(module)(x)
    assert torch.equal(y, module(x)) and y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("output_size", [(1, 2), 2, (3, None)])
def test_cpu_adaptive_avg_pool_to_other_sizes_runs_the_module(output_size) -> None:
    x = torch.randn(1, 4, 6, 6)
    module = torch.nn.AdaptiveAvgPool2d(output_size)
    assert torch.equal(cpu_pool.pooling(module)(x), module(x))


def test_direct_bands_split_the_rows_as_evenly_as_their_count_allows():
    """The threads split the direct kernel's units statically: a short last band would idle the threads given it."""
    from tendril.sparse.ops.conv.cpu.kernel import _even_band_rows

    assert _even_band_rows(56, 17) == _even_band_rows(56, 18) == 14  # 4 bands of 14, not 17, 17, 17, 5
    for rows in range(1, 80):
        for most in range(1, 40):
            band = _even_band_rows(rows, most)
            bands = -(-rows // most)
            assert band <= most and -(-rows // band) == bands and rows - (bands - 1) * band >= band - bands + 1


@pytest.mark.parametrize("threads", [1, 3])
def test_direct_conv_takes_every_count_of_weights_per_channel(threads):
    """Output channel k holds exactly k nonzero weights (0 to 20): every mix of eight-weight passes, the four-weight
    pass and the zero padding, against F.conv2d in float64."""
    from tendril.sparse.format import ConvGeometry, SparseConvWeights

    g = ConvGeometry(6, 21, (2, 2), (1, 1), (1, 1), 1, (5, 7))
    generator = torch.Generator().manual_seed(3)
    weight = torch.zeros(21, 24)
    for k in range(21):
        weight[k, torch.randperm(24, generator=generator)[:k]] = torch.randn(k, generator=generator)
    weight = weight.view(21, 6, 2, 2)
    weights = SparseConvWeights.from_dense(weight, g)
    plan = conv_cpu.CpuConvPlan.prepare(weights)
    assert (plan.k_ptr.diff() % conv_cpu.DIRECT_PAD == 0).all()
    x = torch.randn(6, 5, 7, generator=generator).relu()
    bias = torch.randn(21, generator=generator)
    out = torch.full((21, *g.out_hw), float("nan"))
    conv_cpu.conv_dense_input(x, plan, bias, out=out, layout=ActivationLayout.for_conv(g), threads=threads,
                              method="direct")
    ref = torch.nn.functional.conv2d(x[None].double(), weight.double(), bias.double(), padding=1)[0]
    assert relative_error(out, ref) <= REL_TOL


def test_direct_channel_blocks_split_the_padded_weights_evenly():
    """The threads take the direct kernel's units statically: blocks of equal channel counts would leave the block with
    the most weights setting the time, so the blocks are cut by each channel's cost instead."""
    counts = torch.tensor([40, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4, 36, 8, 8, 8, 8])
    k_ptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    cost = counts + direct_call.WRITE_WEIGHTS
    for blocks in (1, 2, 3, 4, 16):
        starts = direct_call.channel_blocks(k_ptr, blocks)
        assert len(starts) == blocks + 1 and starts[0] == 0 and starts[-1] == len(counts)
        assert (starts[1:] >= starts[:-1]).all()
        block_costs = [int(cost[a:b].sum()) for a, b in itertools.pairwise(starts)]
        assert max(block_costs) <= cost.sum() / blocks + cost.max()
    halves = direct_call.channel_blocks(k_ptr, 2)
    assert max(int(cost[: halves[1]].sum()), int(cost[halves[1] :].sum())) < int(cost[8:].sum())  # 8 + 8 channels


def test_direct_reach_bounds_every_weight_of_its_channel():
    """The direct kernel rounds a channel's band up only where `reach` (its weights' largest base, the padding's
    included) plus the rounded band stays inside the planes: reach must cover every weight the loop reads."""
    case = ConvCase(5, 9, (6, 7), 3, 1, 1, 1, 0.3, 0.5, seed=11)
    weights, *_ = conv_operands(case, CPU)
    plan = conv_cpu.CpuConvPlan.prepare(weights)
    reach = plan.direct_reach
    for k in range(weights.geometry.out_channels):
        bases = plan.direct_base[plan.k_ptr[k] : plan.k_ptr[k + 1]]
        assert int(reach[k]) == (int(bases.max()) if bases.numel() else 0)
