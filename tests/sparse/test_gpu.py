"""GPU: every kernel against its reference over random geometries and densities (0 and 1 included),
whole networks against dense PyTorch, and a converted network replayed inside a CUDA graph."""

import random

import pytest
import torch

from tendril.sparse import ActivationOverflowError, convert, prune
from tendril.sparse.activations import ActivationLayout
from tendril.sparse.ops.compress import reference as compress_reference
from tendril.sparse.ops.compress import triton as compress_triton
from tendril.sparse.ops.conv.cartesian_cuda import kernel as conv_cuda
from tendril.sparse.ops.conv.cartesian_cuda import tiling
from tendril.sparse.ops.conv.cartesian_triton import kernel as conv_triton
from tendril.sparse.ops.conv.registry import DENSE_KERNELS, dense_kernels_for
from tendril.sparse.ops.linear import triton as linear_triton
from tendril.sparse.steps import SparseConvStep, SparseLinearStep
from tests.sparse.checks import (
    CONV_CASES,
    GEMM_CASES,
    REL_TOL,
    ConvCase,
    assert_network_matches_dense,
    assert_same_compression,
    check_conv,
    check_conv_gemm,
    check_linear,
    check_linear_rows,
    conv_operands,
    relative_error,
)
from tests.sparse.models import BasicBlock, Bottleneck, ResNetLike, alexnet_like, randomize_batchnorm, vgg_like

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def _exact_fp32():
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous


def _compress(x, layout):
    return compress_triton.compress(x, layout, torch.zeros(1, dtype=torch.int32, device=x.device))


def _random_conv_cases(n: int, seed: int = 0) -> list[ConvCase]:
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        groups = rng.choice([1, 1, 2, 4])
        kernel = rng.choice([1, 3, 5, 7, 11])
        padding = rng.randint(0, kernel // 2 + 1)
        size = (rng.randint(kernel, 40), rng.randint(kernel, 40))
        case = ConvCase(
            groups * rng.randint(1, 12),
            groups * rng.randint(1, 24),
            size,
            kernel,
            rng.randint(1, 4),
            padding,
            groups,
            rng.choice([0.0, 0.05, 0.3, 0.7, 1.0]),
            rng.choice([0.0, 0.1, 0.5, 1.0]),
            seed=rng.randint(0, 99),
        )
        cases.append(case)
    return cases


@pytest.mark.parametrize("case", CONV_CASES + _random_conv_cases(40))
def test_conv_kernel_matches_dense_conv(case):
    check_conv(case, _compress, conv_triton.conv, CUDA)


def _cuda_conv(target_blocks: int, relu: bool = False):
    def conv(acts, weights, init):
        tiled = tiling.TiledWeights.prepare(weights, tiling.plan(weights.geometry, target_blocks))
        return conv_cuda.conv(acts, weights, tiled, init, relu=relu)

    return conv


@pytest.mark.parametrize("target_blocks", [1, 264])
@pytest.mark.parametrize("case", CONV_CASES + _random_conv_cases(40, seed=1))
def test_cuda_conv_kernel_matches_dense_conv(case, target_blocks):
    check_conv(case, _compress, _cuda_conv(target_blocks), CUDA)


@pytest.mark.parametrize(
    ("channels", "size", "kernel", "stride", "padding"),
    [
        (64, 224, 3, 1, 1),
        (256, 56, 3, 1, 1),
        (512, 14, 3, 1, 1),
        (3, 224, 11, 4, 2),
        (1024, 14, 1, 2, 0),
        (3, 224, 7, 2, 3),
    ],
)
def test_cuda_conv_kernel_on_imagenet_sized_layers(channels, size, kernel, stride, padding):
    case = ConvCase(channels, 64, (size, size), kernel, stride, padding, 1, 0.3, 0.5)
    check_conv(case, _compress, _cuda_conv(264), CUDA)


def test_cuda_conv_fuses_relu():
    case = ConvCase(8, 8, (20, 20), 3, 1, 1, 1, 0.5, 0.5)
    weights, x, init, ref = conv_operands(case, CUDA)
    acts = _compress(x, ActivationLayout.for_conv(weights.geometry))
    y = _cuda_conv(264, relu=True)(acts, weights, init)
    assert relative_error(y.cpu(), ref.relu()) <= REL_TOL


@pytest.mark.parametrize(
    "case",
    GEMM_CASES
    + [c for c in _random_conv_cases(30, seed=2) if c.groups == 1]
    + [ConvCase(1024, 256, (14, 14), 1, 1, 0, 1, 0.2, 0.5), ConvCase(1024, 512, (14, 14), 1, 2, 0, 1, 0.2, 0.5)],
    ids=str,
)
def test_gemm_conv_matches_dense_conv(case):
    check_conv_gemm(case, CUDA, batch=1 + case.seed % 2, residual=case.seed % 3 != 0, relu=case.seed % 2 == 0)


def test_a_gemm_layer_stays_fp32_when_the_user_enables_tf32():
    """A network's GEMM layer runs its product in fp32 even under `allow_tf32` (which measurably loses accuracy
    on this layer: the check can fail)."""
    model = torch.nn.Sequential(torch.nn.Conv2d(256, 256, 3, padding=1), torch.nn.ReLU()).cuda().eval()
    x = torch.rand(1, 256, 14, 14, device=CUDA)
    net = convert(model, x)
    step = net.steps[0]
    step.dense_weight, step.conv_kernel = step.weights.to_dense(), "gemm"
    ref = step.reference([x])
    torch.backends.cuda.matmul.allow_tf32 = True
    with torch.no_grad():
        tf32 = torch.matmul(step.dense_weight.view(256, -1), torch.nn.functional.unfold(x, 3, padding=1))
        assert relative_error((tf32.view_as(ref) + step.bias.view(-1, 1, 1)).relu(), ref) > REL_TOL
        assert relative_error(net(x), ref) <= REL_TOL
        assert torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("block_a,block_w", [(32, 8), (128, 16), (256, 32)])
def test_conv_kernel_block_sizes_on_a_vgg_sized_layer(block_a, block_w):
    case = ConvCase(64, 64, (56, 56), 3, 1, 1, 1, 0.3, 0.5)
    check_conv(case, _compress, lambda a, w, i: conv_triton.conv(a, w, i, block_a=block_a, block_w=block_w), CUDA)


@pytest.mark.parametrize(
    ("features", "outputs", "wd", "ad"),
    [
        (97, 33, 0.3, 0.5),
        (4096, 1000, 0.04, 0.5),
        (9216, 512, 1.0, 1.0),
        (300, 70, 0.0, 0.5),
        (300, 70, 0.5, 0.0),
    ],
)
def test_linear_kernel_matches_dense(features, outputs, wd, ad):
    check_linear(features, outputs, wd, ad, _compress, linear_triton.linear, CUDA)


def test_compression_overflow_raises_the_device_flag_and_keeps_true_counts():
    x = torch.rand(3, 20, 20, device=CUDA) + 0.1
    layout = ActivationLayout(3, (20, 20), (1, 1), (0, 0), 50)
    flag = torch.zeros(1, dtype=torch.int32, device=CUDA)
    acts = compress_triton.compress(x, layout, flag)
    assert flag.item() == 1 and acts.counts.tolist() == [400] * 3
    assert_same_compression(acts, compress_reference.compress(x.cpu(), layout))


NETWORKS = [
    (lambda: alexnet_like(width=16), "alexnet", 127),
    (lambda: vgg_like(width=8, batch_norm=True), 0.3, 64),
    (lambda: ResNetLike(BasicBlock, (2, 2, 2)), 0.2, 64),
    (lambda: ResNetLike(Bottleneck, (2, 2, 2), width=16), 0.2, 96),
]


def pruned_network(index: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """`NETWORKS[index]` pruned on the GPU (seeded by `index`) and an input placeholder for it."""
    build, densities, size = NETWORKS[index]
    torch.manual_seed(index)
    model = randomize_batchnorm(build()).eval().to(CUDA)
    prune(model, densities)
    return model, torch.randn(1, 3, size, size, device=CUDA)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("index", range(len(NETWORKS)))
def test_network_matches_dense_pytorch_eager_and_inside_a_cuda_graph(index, backend):
    model, placeholder = pruned_network(index)
    net = convert(model, placeholder, dense_fallback=False).set_backend(backend)
    assert_network_matches_dense(net, model, placeholder, replays=5)
    net.check_overflow()
    assert "dense" not in {s.conv_kernel for s in net.steps if isinstance(s, SparseConvStep)}


@pytest.mark.parametrize("index", range(len(NETWORKS)))
def test_a_dense_fallback_is_timed_per_layer_and_runs_fp32_exactly_as_the_sparse_kernels(index):
    """`tune` times cuDNN on every convolution's dense pruned weights; a layer that runs densely (here every
    one, forced) matches dense PyTorch eagerly and inside a graph, and its dense copy is counted in the
    network's weight bytes."""
    model, placeholder = pruned_network(index)
    net = convert(model, placeholder)
    convs = [s for s in net.steps if isinstance(s, SparseConvStep)]
    assert convs and all("dense" in net.kernel_times[s.name] for s in convs)
    assert all(set(dense_kernels_for(s)) <= set(net.kernel_times[s.name]) for s in convs)
    assert any("gemm" in net.kernel_times[s.name] for s in convs)
    compressed, _ = net.weight_bytes()
    added = sum(4 * s.weights.dense_numel for s in convs if s.dense_weight is None)
    for kernel in DENSE_KERNELS:
        for step in convs:
            step.dense_weight = step.weights.to_dense()
            step.conv_kernel = kernel if kernel in dense_kernels_for(step) else "dense"
        assert net.weight_bytes()[0] == compressed + added
        assert_network_matches_dense(net, model, placeholder, replays=3)


def test_releasing_unused_kernels_frees_their_copies_and_keeps_the_network_exact():
    """After `tune`, every GPU layer holds the shared-memory kernel's tile-ordered weights (and dense or register
    copies): `release_unused_kernels` keeps only what each chosen kernel reads, counted in `weight_bytes`."""
    model, placeholder = pruned_network(2)
    net = convert(model, placeholder)
    held = net.weight_bytes()[0]
    steps = [s for s in net.steps if isinstance(s, SparseConvStep)]
    assert all(s.tiled is not None for s in steps)
    steps[0].conv_kernel = "triton"  # reads the compressed weights only
    not_cuda = [s for s in steps if s.conv_kernel != "cuda"]
    net.release_unused_kernels()
    assert net.weight_bytes()[0] < held
    assert all(s.tiled is None for s in not_cuda)
    assert all((s.register is not None) == (s.conv_kernel == "register") for s in steps)
    assert_network_matches_dense(net, model, placeholder, replays=2)
    not_cuda[0].conv_kernel = "cuda"
    with pytest.raises(ValueError, match="tile-ordered weights are not held"):
        net(placeholder)


def test_plain_forwards_leave_the_extra_counts_to_tune_and_profile():
    """Layers whose kernels do not count their input's nonzeros (cuDNN, the FC row kernel) count them only in
    `tune`, `profile` and forwards with `count_activations`: a plain forward leaves their densities as they were."""
    model, placeholder = pruned_network(0)
    net = convert(model, placeholder)
    convs = [s for s in net.steps if isinstance(s, SparseConvStep)]
    convs[0].dense_weight = convs[0].weights.to_dense()
    convs[0].conv_kernel = "dense"
    counted = {s.name for s in net.steps if isinstance(s, SparseLinearStep) and s.fc_kernel == "rows"} | {convs[0].name}
    net.profile(placeholder)
    tuned = {r.name: r.activation_density for r in net.layers()}
    assert all(tuned[name] is not None for name in counted)
    net(torch.zeros_like(placeholder))  # a zero input: every density would change if counted
    plain = {r.name: r.activation_density for r in net.layers()}
    assert all(plain[name] == tuned[name] for name in counted)
    net.count_activations = True
    net(torch.zeros_like(placeholder))
    assert plain[convs[0].name] != 0 and {r.name: r.activation_density for r in net.layers()}[convs[0].name] == 0


@pytest.mark.parametrize(
    ("features", "outputs", "weight_density", "act_density"),
    [(97, 33, 0.3, 0.5), (97, 33, 1.0, 1.0), (97, 33, 0.0, 0.5), (9216, 4096, 0.09, 0.64), (4096, 1000, 0.25, 0.5)],
)
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("config", linear_triton.ROWS_CONFIGS)
def test_row_gather_linear_kernel_matches_dense(features, outputs, weight_density, act_density, relu, config):
    check_linear_rows(features, outputs, weight_density, act_density, relu, CUDA, config)


@pytest.mark.parametrize("index", range(len(NETWORKS)))
def test_fully_connected_layers_are_timed_both_ways_and_the_row_kernel_matches_dense(index):
    model, placeholder = pruned_network(index)
    net = convert(model, placeholder)
    linears = [s for s in net.steps if isinstance(s, SparseLinearStep)]
    assert linears and all(set(net.kernel_times[s.name]) == {"spmspv", "rows"} for s in linears)
    for step in linears:
        step.csr = step.weights.to_csr()
        step.fc_kernel = "rows"
    assert_network_matches_dense(net, model, placeholder, replays=3)


def test_network_overflow_inside_a_graph_is_reported_after_the_replay():
    model = vgg_like(width=8).eval().to(CUDA)
    x = torch.rand(1, 3, 32, 32, device=CUDA) + 0.1
    net = convert(model, x, activation_capacity=0.05)
    for step in net.steps:  # the kernels that read compressed activations (the others never overflow)
        if isinstance(step, SparseConvStep):
            step.conv_kernel = "cuda"
    graph = torch.cuda.CUDAGraph()
    net(x)
    net.reset_overflow()
    with torch.cuda.graph(graph):
        net(x)
    graph.replay()
    with pytest.raises(ActivationOverflowError):
        net.check_overflow()
