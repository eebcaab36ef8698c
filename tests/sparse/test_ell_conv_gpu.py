"""GPU: the `"ell"` Triton kernel against the float64 reference on random geometries (1×1, strided, padded,
grouped, odd sizes; densities from 0 to 1, an empty channel in each) in fp16, bf16 and fp32 with NaN-poisoned
outputs, every tile config of `tune` on ResNet-50-, VGG-16- and AlexNet-sized layers at low densities, replays
of a CUDA graph that captured it, and networks forced onto it (eager and in a graph) or tuned with it."""

from __future__ import annotations

import random

import pytest
import torch

from tendril.sparse import convert, prune
from tendril.sparse.ops.conv.ell import dataflow as ell_dataflow
from tendril.sparse.ops.conv.ell import kernel as ell_kernel
from tendril.sparse.ops.conv.ell.packing import EllConfig, pack
from tendril.sparse.steps import SparseConvStep
from tests.sparse.checks import assert_network_matches_dense
from tests.sparse.ell_checks import CASES, TOLERANCE, EllCase, check_case, operands, relative_error
from tests.sparse.models import BasicBlock, Bottleneck, ResNetLike, alexnet_like, randomize_batchnorm, vgg_like

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def random_cases(count: int, seed: int) -> list[EllCase]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        kernel = rng.choice([1, 1, 3, 3, 5])
        stride = rng.choice([1, 1, 2])
        groups = rng.choice([1, 1, 1, 2, 4])
        cases.append(
            EllCase(
                channels=groups * rng.randint(1, 24),
                out_channels=groups * rng.randint(1, 40),
                size=(rng.randint(kernel, 37), rng.randint(kernel, 37)),
                kernel=(kernel, kernel),
                stride=stride,
                padding=rng.choice([0, kernel // 2]),
                density=rng.choice([0.0, 0.05, 0.1, 0.3, 0.6, 1.0]),
                groups=groups,
                batch=rng.choice([1, 1, 2]),
                residual=rng.random() < 0.5,
                relu=rng.random() < 0.5,
                seed=seed * 1000 + i,
            )
        )
    return cases


RANDOM_CASES = CASES + random_cases(30, seed=3)
NETWORK_LAYERS = [  # (in, out, input size, kernel, stride, padding): ResNet-50, VGG-16 and AlexNet convolutions
    (64, 256, 56, 1, 1, 0),
    (256, 64, 56, 1, 1, 0),
    (64, 64, 56, 3, 1, 1),
    (512, 1024, 28, 1, 2, 0),
    (256, 256, 14, 3, 1, 1),
    (512, 2048, 7, 1, 1, 0),
    (512, 512, 7, 3, 1, 1),
    (3, 64, 224, 7, 2, 3),
    (64, 64, 224, 3, 1, 1),
    (512, 512, 14, 3, 1, 1),
    (3, 64, 224, 11, 4, 2),
    (192, 384, 13, 3, 1, 1),
]


@pytest.mark.parametrize("index", range(len(RANDOM_CASES)))
@pytest.mark.parametrize("dtype", DTYPES)
def test_random_geometries_match_the_float64_reference(index, dtype):
    """Each case under two of `tune`'s configs (in turn), the output poisoned with NaN."""
    configs = ell_dataflow.CONFIGS
    for config in (configs[index % len(configs)], configs[(index + 2) % len(configs)]):
        check_case(RANDOM_CASES[index], config, dtype, CUDA)


@pytest.mark.parametrize("layer", NETWORK_LAYERS)
@pytest.mark.parametrize("density", [0.3, 0.05])
def test_network_sized_layers_match_under_every_config(layer, density):
    c, k, size, kernel, stride, padding = layer
    case = EllCase(c, k, (size, size), (kernel, kernel), stride, padding, density, residual=True, relu=True)
    for config in ell_dataflow.CONFIGS:  # split ones included, whatever configs_for would keep
        check_case(case, config, torch.float16, CUDA)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_a_cuda_graph_replays_the_kernel_on_new_inputs(dtype, splits):
    """Split configs included: their tickets start from zero on every replay."""
    case = EllCase(64, 48, (14, 14), (3, 3), 1, 1, 0.2, residual=True, relu=True)
    weights, x, bias, residual, _ = operands(case, dtype, CUDA)
    packed = pack(weights, EllConfig(4, 4, 64, 4, splits=splits))
    ell_kernel.conv(x, packed, bias, residual=residual, relu=True)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ell_kernel.conv(x, packed, bias, residual=residual, relu=True)
    dense = weights.to_dense().double()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        ref = torch.nn.functional.conv2d(x.double(), dense, bias.double(), padding=1) + residual.double()
        assert relative_error(out, ref.relu().cpu()) <= TOLERANCE[dtype]


NETWORKS = [
    (lambda: alexnet_like(width=16), 0.1, 127),
    (lambda: vgg_like(width=8, batch_norm=True), 0.1, 64),
    (lambda: ResNetLike(Bottleneck, (2, 2), width=8), 0.2, 64),
    (lambda: ResNetLike(BasicBlock, (2, 2, 2)), 0.05, 64),
]


@pytest.mark.parametrize("index", range(len(NETWORKS)))
def test_networks_forced_onto_the_kernel_match_dense_eagerly_and_in_a_graph(index):
    build, density, size = NETWORKS[index]
    torch.manual_seed(index)
    model = randomize_batchnorm(build()).eval().to(CUDA)
    prune(model, density)
    placeholder = torch.randn(1, 3, size, size, device=CUDA)
    net = convert(model, placeholder)
    steps = [s for s in net.steps if isinstance(s, SparseConvStep)]
    for step in steps:
        step.ell = pack(step.weights, ell_dataflow.configs_for(step)[0])
        step.conv_kernel = "ell"
    assert_network_matches_dense(net, model, placeholder, replays=3)


def test_tune_times_the_kernel_and_keeps_only_the_chosen_copy():
    torch.manual_seed(0)
    model = randomize_batchnorm(ResNetLike(Bottleneck, (2, 2), width=8)).eval().to(CUDA)
    prune(model, 0.1)
    net = convert(model, torch.randn(1, 3, 64, 64, device=CUDA))
    steps = [s for s in net.steps if isinstance(s, SparseConvStep)]
    assert all("ell" in net.kernel_times[s.name] for s in steps), net.rejected_kernels
    assert all((s.ell is not None) == (s.conv_kernel == "ell") for s in steps)
