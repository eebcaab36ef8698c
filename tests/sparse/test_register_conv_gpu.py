"""GPU: the register-tiled sparse-weight kernel against the dense convolution over random geometries
and densities (0 and 1 included), with NaN-poisoned outputs, forced small plans (several tiles,
k-blocks, chunks and channel splits), fused residual/ReLU, determinism and CUDA-graph replays of the
ticketed split reduction, VGG-16-sized layers, and networks forced onto the kernel. Pixel runs (1×1
convolutions) the same way: planned and small plans over random 1×1 geometries (strides 1 and 2, odd
sizes), ResNet-50's 1×1 layers, both layouts of their shortlists, unaligned inputs and outputs (the
4-byte copy and scalar store paths), and a split plan replayed in a CUDA graph."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn.functional as F

from tendril.sparse import convert, prune
from tendril.sparse.ops.conv.register import kernel as register_cuda
from tendril.sparse.ops.conv.register import planner as register_planner
from tendril.sparse.ops.conv.register import tiling as register_tiling
from tendril.sparse.ops.conv.register.kernel import RegisterConvLayer
from tendril.sparse.steps import SparseConvStep
from tests.sparse.checks import (
    CONV_CASES,
    REL_TOL,
    ConvCase,
    assert_network_matches_dense,
    conv_operands,
    relative_error,
)
from tests.sparse.models import BasicBlock, ResNetLike, alexnet_like, randomize_batchnorm, vgg_like
from tests.sparse.test_register_conv import (
    RUN_CASES,
    SMALL_RUN_CASES,
    random_cases,
    random_run_cases,
    small_plan,
    small_run_plan,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SMS = 132


VGG16_CASES = [
    (3, 64, 224, 0.58, 1.0),
    (64, 64, 224, 0.22, 0.5),
    (128, 256, 56, 0.53, 0.67),
    (512, 512, 28, 0.27, 0.5),
    (512, 512, 14, 0.35, 0.54),
    (512, 512, 14, 1.0, 1.0),
]
PLANNED_CASES = CONV_CASES + random_cases(40, seed=5)
SMALL_PLAN_CASES = random_cases(40, seed=13)
SPLIT_CASE = ConvCase(256, 128, (14, 14), 3, 1, 1, 1, 0.3, 0.5)
GPU_RUN_CASES = RUN_CASES + random_run_cases(24, seed=31)
RESNET50_1X1_CASES = [  # (in, out, input size, stride): bottleneck reduce/expand and downsample layers
    (256, 64, 56, 1),
    (64, 256, 56, 1),
    (256, 512, 56, 2),
    (512, 128, 28, 1),
    (1024, 256, 14, 1),
    (1024, 2048, 14, 2),
    (2048, 512, 7, 1),
    (512, 2048, 7, 1),
]


def _resnet_case(channels: int, out_channels: int, size: int, stride: int) -> ConvCase:
    return ConvCase(channels, out_channels, (size, size), 1, stride, 0, 1, 0.2, 0.6)


def _vgg_case(channels: int, out_channels: int, size: int, weight_density: float, act_density: float) -> ConvCase:
    return ConvCase(channels, out_channels, (size, size), 3, 1, 1, 1, weight_density, act_density)


@pytest.fixture(scope="module", autouse=True)
def _precompiled_kernels():
    """Compile every plan these tests launch at once, in parallel processes (each plan is its own fully
    unrolled kernel, ~1 s of ptxas): the same cases, densities and plans as the tests derive."""
    plans = []
    for case in PLANNED_CASES + [_vgg_case(*spec) for spec in VGG16_CASES]:
        weights = conv_operands(case, torch.device("cpu"))[0]
        plans.append(register_planner.plan(weights.geometry, weights.density, SMS))
    plans += [small_plan(case.geometry, random.Random(index)) for index, case in enumerate(SMALL_PLAN_CASES)]
    split = conv_operands(SPLIT_CASE, torch.device("cpu"))[0]
    plans += register_planner.candidates(split.geometry, split.density, SMS)[:4]
    for case in GPU_RUN_CASES:
        weights = conv_operands(case, torch.device("cpu"))[0]
        plans.append(register_planner.plan(weights.geometry, weights.density, SMS))
    plans += [small_run_plan(case.geometry, random.Random(index)) for index, case in enumerate(SMALL_RUN_CASES)]
    for spec in RESNET50_1X1_CASES:
        weights = conv_operands(_resnet_case(*spec), torch.device("cpu"))[0]
        plans += register_planner.shortlist(weights.geometry, weights.density, SMS, 3)
    try:
        register_cuda.precompile(plans)
    except RuntimeError as error:  # the tests still run, compiling each kernel when first launched
        warnings.warn(f"precompiling failed: {error}", stacklevel=1)


@pytest.fixture(autouse=True)
def _exact_fp32():
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous


def check(case: ConvCase, plan_for, *, relu: bool = False, residual: bool = False, seed: int = 0) -> None:
    weights, x, init, ref = conv_operands(case, CUDA)
    g = weights.geometry
    bias = init[:, 0, 0].contiguous()
    resid = None
    if residual:
        resid = torch.randn(g.out_channels, *g.out_hw, generator=torch.Generator().manual_seed(seed)).to(CUDA)
        ref = ref + resid.double().cpu()
    if relu:
        ref = ref.relu()
    layer = RegisterConvLayer.prepare(weights, plan_for(g, weights.density))
    out = torch.full((g.out_channels, *g.out_hw), float("nan"), device=CUDA)
    y = register_cuda.conv(x, layer, bias, residual=resid, relu=relu, out=out)
    assert y is out and not y.isnan().any(), "an output was never written"
    if ref.abs().max() == 0:
        assert torch.equal(y.cpu(), torch.zeros_like(y.cpu()))
    else:
        assert relative_error(y.cpu(), ref) <= REL_TOL, (case, layer.plan)
    assert int(layer.counts.sum()) == int((x != 0).sum())
    assert not layer.tickets.any(), "every tile's last split resets its ticket"


@pytest.mark.parametrize("case", PLANNED_CASES)
def test_register_conv_with_the_planned_tiles_matches_dense_conv(case):
    check(case, lambda g, d: register_planner.plan(g, d, SMS))


@pytest.mark.parametrize("index", range(40))
def test_register_conv_with_small_tiles_splits_residual_and_relu(index):
    case = SMALL_PLAN_CASES[index]
    rng = random.Random(index)
    check(case, lambda g, d: small_plan(g, rng), relu=rng.random() < 0.5, residual=rng.random() < 0.5, seed=index)


@pytest.mark.parametrize("spec", VGG16_CASES)
def test_register_conv_on_vgg16_layers(spec):
    check(_vgg_case(*spec), lambda g, d: register_planner.plan(g, d, SMS), relu=True)


@pytest.mark.parametrize("candidate", range(4))
def test_every_top_candidate_plan_of_a_split_layer_is_correct(candidate):
    check(SPLIT_CASE, lambda g, d: register_planner.candidates(g, d, SMS)[candidate], relu=True)


@pytest.mark.parametrize(
    ("case", "padding", "pixel_run"),
    [
        (ConvCase(512, 256, (14, 14), 3, 1, 1, 1, 0.3, 0.5), 1, False),
        (_resnet_case(1024, 256, 14, 1), 0, True),
    ],
    ids=["3x3 tile", "1x1 pixel run"],
)
def test_split_reduction_is_deterministic_and_replays_in_a_cuda_graph(case, padding, pixel_run):
    weights, x, init, _ = conv_operands(case, CUDA)
    plan = register_planner.plan(weights.geometry, weights.density, SMS)
    assert plan.splits > 1 and plan.pixel_run == pixel_run
    layer = RegisterConvLayer.prepare(weights, plan)
    bias = init[:, 0, 0].contiguous()
    first = register_cuda.conv(x, layer, bias, relu=True)
    for _ in range(3):
        assert torch.equal(register_cuda.conv(x, layer, bias, relu=True), first)
    placeholder = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        register_cuda.conv(placeholder, layer, bias, relu=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = register_cuda.conv(placeholder, layer, bias, relu=True)
    for seed in range(4):
        fresh = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).relu().to(CUDA)
        placeholder.copy_(fresh)
        out.fill_(float("nan"))
        graph.replay()
        dense = F.conv2d(fresh[None], weights.to_dense(), bias, padding=padding)[0].relu()
        assert relative_error(out, dense) <= REL_TOL
    assert not layer.tickets.any()


NETWORKS = [
    (lambda: alexnet_like(width=16), "alexnet", 127),
    (lambda: vgg_like(width=8, batch_norm=True), 0.3, 64),
    (lambda: ResNetLike(BasicBlock, (2, 2, 2)), 0.2, 64),
]


@pytest.mark.parametrize("index", range(len(NETWORKS)))
def test_network_on_the_register_kernel_matches_dense_eager_and_in_a_graph(index):
    build, densities, size = NETWORKS[index]
    torch.manual_seed(index)
    model = randomize_batchnorm(build()).eval().to(CUDA)
    prune(model, densities)
    placeholder = torch.randn(1, 3, size, size, device=CUDA)
    net = convert(model, placeholder)  # tune builds the register layers where supported
    forced = 0
    for step in net.steps:
        if isinstance(step, SparseConvStep) and step.register is not None:
            step.conv_kernel = "register"
            forced += 1
    assert forced > 0
    assert_network_matches_dense(net, model, placeholder, replays=3)
    for report in net.layers():
        if report.kind == "conv":
            assert report.activation_density is not None and 0.0 <= report.activation_density <= 1.0
    net.check_overflow()


@pytest.mark.parametrize("case", GPU_RUN_CASES)
def test_pixel_run_conv_with_the_planned_runs_matches_dense_conv(case):
    def planned(g, d):
        plan = register_planner.plan(g, d, SMS)
        assert plan.pixel_run
        return plan

    check(case, planned, relu=True, residual=case.seed % 2 == 0, seed=case.seed)


@pytest.mark.parametrize("index", range(len(SMALL_RUN_CASES)))
def test_pixel_run_conv_with_small_runs_splits_residual_and_relu(index):
    rng = random.Random(index)
    check(
        SMALL_RUN_CASES[index],
        lambda g, d: small_run_plan(g, rng),
        relu=rng.random() < 0.5,
        residual=rng.random() < 0.5,
        seed=index,
    )


@pytest.mark.parametrize("spec", RESNET50_1X1_CASES)
@pytest.mark.parametrize("rank", range(3))
def test_every_shortlisted_plan_of_resnet50_1x1_layers_is_correct(spec, rank):
    check(
        _resnet_case(*spec), lambda g, d: register_planner.shortlist(g, d, SMS, 3)[rank], relu=True, residual=rank == 0
    )


@pytest.mark.parametrize("stride", [1, 2])
def test_pixel_run_conv_on_unaligned_input_and_output(stride):
    """Inputs and outputs one float off 16-byte alignment take the 4-byte copy and scalar store paths."""
    case = ConvCase(40, 24, (12, 16), 1, stride, 0, 1, 0.3, 0.6)
    weights, x, init, ref = conv_operands(case, CUDA)
    g = weights.geometry
    plan = register_tiling.RegisterTilePlan(g, 1, 8, 4, 32, 1, 4, warps=4, pixel_run=True)
    assert plan.vector == 4
    layer = RegisterConvLayer.prepare(weights, plan)
    bias = init[:, 0, 0].contiguous()
    x_unaligned = torch.empty(x.numel() + 1, device=CUDA)[1:].view_as(x)
    x_unaligned.copy_(x)
    resid = torch.randn(g.out_channels, *g.out_hw, generator=torch.Generator().manual_seed(1)).to(CUDA)
    resid_unaligned = torch.empty(resid.numel() + 1, device=CUDA)[1:].view_as(resid)
    resid_unaligned.copy_(resid)
    out = torch.full((resid.numel() + 1,), float("nan"), device=CUDA)[1:].view_as(resid)
    for inputs in ((x_unaligned, resid), (x, resid_unaligned), (x_unaligned, resid_unaligned)):
        out.fill_(float("nan"))
        y = register_cuda.conv(inputs[0], layer, bias, residual=inputs[1], relu=True, out=out)
        assert not y.isnan().any(), "an output was never written"
        assert relative_error(y.cpu(), (ref + resid.double().cpu()).relu()) <= REL_TOL
        assert int(layer.counts.sum()) == int((x != 0).sum())
