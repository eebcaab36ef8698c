"""GPU: fp16 and bf16 networks and the kernels that run them, against float64 references on the same rounded
operands: each kernel over random geometries, each layer of a tuned network by the kernel `tune` chose and by
every kernel that runs its dtype, whole networks eagerly and replayed inside a CUDA graph (output poisoned)."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tendril.sparse import convert
from tendril.sparse.ops.compress import triton as compress_triton
from tendril.sparse.ops.conv.cartesian_triton import kernel as conv_triton
from tendril.sparse.ops.conv.registry import BY_NAME, DENSE_KERNELS, dense_kernels_for
from tendril.sparse.ops.linear import triton as linear_triton
from tendril.sparse.steps import SparseConvStep, SparseLinearStep
from tests.sparse.checks import CONV_CASES, GEMM_CASES, graph_replays
from tests.sparse.half_checks import (
    HALF_DTYPES,
    NETWORK_TOL,
    OUTPUT_TOL,
    check_conv_gemm_half,
    check_conv_half,
    check_linear_half,
    check_linear_rows_half,
    check_network_half,
    relative_l2,
)
from tests.sparse.test_gpu import NETWORKS, _random_conv_cases, pruned_network

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
DTYPES = pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["fp16", "bf16"])


def _compress(x, layout):
    return compress_triton.compress(x, layout, torch.zeros(1, dtype=torch.int32, device=x.device))


@DTYPES
@pytest.mark.parametrize("case", CONV_CASES + _random_conv_cases(20, seed=3))
def test_triton_conv_and_compression_in_half(case, dtype):
    check_conv_half(case, _compress, conv_triton.conv, dtype, CUDA)


@DTYPES
@pytest.mark.parametrize("case", GEMM_CASES)
def test_gemm_conv_in_half(case, dtype):
    check_conv_gemm_half(case, dtype, CUDA)


@DTYPES
@pytest.mark.parametrize("config", linear_triton.ROWS_CONFIGS)
def test_linear_kernels_in_half(dtype, config):
    check_linear_half(4096, 1000, _compress, linear_triton.linear, dtype, CUDA)
    check_linear_rows_half(4096, 1000, dtype, CUDA, config)


def _half_network(index: int, dtype: torch.dtype, **options):
    model, placeholder = pruned_network(index)
    model, placeholder = model.to(dtype), placeholder.to(dtype)
    with pytest.warns(UserWarning, match="runs float32 only"):
        net = convert(model, placeholder, **options)
    return model, placeholder, net


def _linear_reference(step: SparseLinearStep, x: torch.Tensor) -> torch.Tensor:
    y = F.linear(x.double(), step.weights.to_dense().double(), step.bias.double())
    return y.relu() if step.relu else y


def _check_every_layer(net, x: torch.Tensor, dtype: torch.dtype, kernels_of) -> None:
    """Walk one forward; every sparse layer's output, by each kernel `kernels_of(step)` names (a conv) or its
    chosen one (an FC layer), against the layer's float64 reference on the same input."""
    values = {net.input_name: x}
    for step in net.steps:
        args = [values[name] for name in step.inputs]
        if isinstance(step, SparseConvStep):
            chosen = step.conv_kernel
            for kernel in kernels_of(step):
                step.conv_kernel = kernel
                y = step.run(args, net.state)
                assert y.dtype == dtype
                assert relative_l2(y, step.reference(args)) <= OUTPUT_TOL[dtype], (step.name, kernel)
            step.conv_kernel = chosen
        elif isinstance(step, SparseLinearStep):
            y = step.run(args, net.state)
            assert y.dtype == dtype
            assert relative_l2(y, _linear_reference(step, args[0])) <= OUTPUT_TOL[dtype], step.name
        values[step.output] = step.run(args, net.state)


def _assert_graph_replays_match(net, model, placeholder: torch.Tensor, dtype: torch.dtype, replays: int) -> None:
    """Captured in a CUDA graph reading `placeholder`, `net` matches the float64 model on fresh inputs, the graph's
    output poisoned (NaN) before each replay."""
    double_model = copy.deepcopy(model).double()
    with torch.no_grad():
        for x, out in graph_replays(net, placeholder, replays):
            assert relative_l2(out, double_model(x.double())) <= NETWORK_TOL[dtype]
    net.check_overflow()


@DTYPES
@pytest.mark.parametrize("index", range(len(NETWORKS)))
def test_tuned_half_network_per_layer_end_to_end_and_in_a_cuda_graph(index, dtype):
    """`tune` on a half network skips the fp32-only CUDA C++ kernels (reason recorded), times the Triton kernel and
    the dense ones in the network's dtype; every layer agrees with its float64 reference by its chosen kernel, by
    the Triton kernel and by every dense kernel that serves it; the network agrees end to end and in a graph."""
    model, placeholder, net = _half_network(index, dtype)
    convs = [s for s in net.steps if isinstance(s, SparseConvStep)]
    for step in convs:
        assert {"triton", "dense"} <= set(net.kernel_times[step.name])
        assert not {"cuda", "register"} & set(net.kernel_times[step.name])
        assert set(net.rejected_kernels[step.name]) >= {"cuda", "register"}
        assert "runs float32 only" in net.rejected_kernels[step.name]["cuda"]
        assert step.conv_kernel not in ("cuda", "register")
        if step.dense_weight is not None:
            assert step.dense_weight.dtype == dtype
    _check_every_layer(net, placeholder, dtype, lambda step: [step.conv_kernel, "triton"])
    for step in convs:
        step.dense_weight = step.weights.to_dense()
    _check_every_layer(
        net,
        placeholder,
        dtype,
        lambda step: [k for k in dense_kernels_for(step) if k not in net.rejected_kernels.get(step.name, {})],
    )
    check_network_half(model, placeholder, dtype, net)
    _assert_graph_replays_match(net, model, placeholder, dtype, replays=3)


@DTYPES
@pytest.mark.parametrize("index", [1, 3])
def test_sparse_only_half_network_end_to_end_and_in_a_cuda_graph(index, dtype):
    model, placeholder, net = _half_network(index, dtype, dense_fallback=False)
    kernels = {s.conv_kernel for s in net.steps if isinstance(s, SparseConvStep)}
    assert kernels and not kernels & set(DENSE_KERNELS), kernels
    assert all(dtype in BY_NAME[name].dtypes for name in kernels), kernels
    check_network_half(model, placeholder, dtype, net)
    _assert_graph_replays_match(net, model, placeholder, dtype, replays=3)
    net.set_backend("triton")
    check_network_half(model, placeholder, dtype, net)


@DTYPES
def test_forcing_an_fp32_only_kernel_on_a_half_layer_raises(dtype):
    _, placeholder, net = _half_network(0, dtype)
    step = next(s for s in net.steps if isinstance(s, SparseConvStep))
    for kernel in ("cuda", "register"):
        step.conv_kernel = kernel
        with pytest.raises(ValueError, match=f"{step.name}: the {kernel} kernel runs float32 only"):
            net(placeholder)


def test_fp32_networks_still_default_to_the_cuda_kernel_and_time_every_kernel():
    model, placeholder = pruned_network(2)
    net = convert(model, placeholder, tune=False)
    assert net.dtype == torch.float32
    assert {s.conv_kernel for s in net.steps if isinstance(s, SparseConvStep)} == {"cuda"}
    net.tune(placeholder)
    convs = [s for s in net.steps if isinstance(s, SparseConvStep)]
    assert all({"cuda", "triton", "dense"} <= set(net.kernel_times[s.name]) for s in convs)
