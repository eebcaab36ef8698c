"""`SparseNetwork.tune` admits the register-tiled kernel only when a layer's output agrees with the layer's
float64 dense reference: the agreement check on the CPU, on real converted layers whose register kernel is
the CPU emulation of its exact algorithm.

The reference is not another kernel: the shared-memory kernel is wrong by design when a reduced activation
capacity overflows, and would make a correct register kernel look wrong;
`test_a_correct_kernel_is_admitted_when_the_shared_memory_kernel_is_wrong` is that case.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tendril.sparse import convert, prune
from tendril.sparse.network import SparseNetwork
from tendril.sparse.ops.conv.cartesian_cuda.dataflow import CartesianCudaKernel
from tendril.sparse.ops.conv.cartesian_triton.dataflow import CartesianTritonKernel
from tendril.sparse.ops.conv.register import emulation as register_emulation
from tendril.sparse.ops.conv.register import kernel as register_cuda
from tendril.sparse.ops.conv.register import planner as register_planner
from tendril.sparse.steps import RunState, SparseConvStep
from tendril.sparse.tuning import AGREEMENT_RTOL, KernelTuner
from tests.sparse.models import BasicBlock, Bottleneck, ResNetLike, randomize_batchnorm, vgg_like


def _emulated_register_conv(x, layer, bias, *, residual=None, relu=False, out=None):
    y, counts = register_emulation.conv(x, layer.weights, bias, residual=residual, relu=relu)
    layer.counts.copy_(counts)
    return y


@pytest.fixture
def overflowed_shared_memory_kernel(monkeypatch):
    """Under the "cuda" backend, the register kernel runs as its CPU emulation and the shared-memory path
    (compression + kernel) returns garbage, as it does when a reduced activation capacity overflowed."""
    monkeypatch.setattr(register_cuda, "conv", _emulated_register_conv)
    monkeypatch.setattr(RunState, "compress", lambda self, step, x, layout: None)
    monkeypatch.setattr(
        CartesianCudaKernel, "convolve", lambda self, step, acts, init, state: torch.full_like(init, 1e6)
    )


@torch.no_grad()
def _network_and_inputs(model: nn.Module, size: int) -> tuple[SparseNetwork, dict[str, list[torch.Tensor]]]:
    """A CPU network with every conv's register layer prepared, each conv step's real inputs, and the network
    then switched to the "cuda" backend's dispatch (the kernels themselves are patched by the tests)."""
    torch.manual_seed(0)
    model = randomize_batchnorm(model).eval()
    prune(model, 0.4)
    x = torch.randn(1, 3, size, size)
    net = convert(model, x)
    values = {net.input_name: x}
    inputs = {}
    for step in net.steps:
        args = [values[name] for name in step.inputs]
        if isinstance(step, SparseConvStep):
            inputs[step.name] = args
            plan = register_planner.plan(step.weights.geometry, step.weights.density, 132)
            step.register = register_cuda.RegisterConvLayer.prepare(step.weights, plan)
        values[step.output] = step.run(args, net.state)
    net.state = RunState("cuda", 1, net.state.overflow)
    return net, inputs


@pytest.mark.parametrize(
    ("build", "size"), [(lambda: vgg_like(width=4), 16), (lambda: ResNetLike(BasicBlock, (1, 1)), 16)]
)
def test_a_correct_kernel_is_admitted_when_the_shared_memory_kernel_is_wrong(
    overflowed_shared_memory_kernel, build, size
):
    net, inputs = _network_and_inputs(build(), size)
    assert inputs
    for step in net.steps:
        if isinstance(step, SparseConvStep):
            step.conv_kernel = "cuda"
            assert float(step.run(inputs[step.name], net.state).min()) == 1e6  # the shared-memory path is wrong
            assert KernelTuner(net).rejection(step, inputs[step.name], "register") is None, step.name


def test_bottleneck_1x1_layers_run_as_admitted_pixel_runs_with_their_fused_epilogue(overflowed_shared_memory_kernel):
    """ResNet bottlenecks' 1×1 reduce/expand (residual + ReLU fused into the expand) and strided downsample
    layers plan as pixel runs, and their emulated kernel agrees with the dense reference."""
    net, inputs = _network_and_inputs(ResNetLike(Bottleneck, (1, 1)), 16)
    runs = [s for s in net.steps if isinstance(s, SparseConvStep) and s.register and s.register.plan.pixel_run]
    assert {s.weights.geometry.stride for s in runs} == {(1, 1), (2, 2)} and any(s.residual for s in runs)
    for step in runs:
        assert KernelTuner(net).rejection(step, inputs[step.name], "register") is None, step.name


@torch.no_grad()
def test_the_reference_is_the_dense_layer_with_its_fused_epilogue():
    net, inputs = _network_and_inputs(ResNetLike(BasicBlock, (1, 1)), 16)
    steps = [s for s in net.steps if isinstance(s, SparseConvStep)]
    assert any(s.residual for s in steps) and any(s.relu for s in steps)
    for step in steps:
        args = inputs[step.name]
        g = step.weights.geometry
        y = F.conv2d(args[0], step.weights.to_dense(), step.bias, stride=g.stride, padding=g.padding, groups=g.groups)
        y = y + args[1] if step.residual else y
        y = y.relu() if step.relu else y
        reference = step.reference(args)
        assert reference.dtype == torch.float64
        assert torch.allclose(reference, y.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("wrong", "reason"),
    [
        (lambda y: y * (1 + AGREEMENT_RTOL * 10), "relative error 1.00e-04 against the dense reference"),
        (lambda y: torch.full_like(y, float("nan")), "relative error nan"),
        (lambda y: y.flip(1), "relative error"),
    ],
)
def test_a_disagreeing_kernel_is_rejected_with_its_error(monkeypatch, wrong, reason):
    net, inputs = _network_and_inputs(vgg_like(width=4), 16)
    monkeypatch.setattr(register_cuda, "conv", lambda *a, **k: wrong(_emulated_register_conv(*a, **k)))
    step = next(s for s in net.steps if isinstance(s, SparseConvStep))
    rejection = KernelTuner(net).rejection(step, inputs[step.name], "register")
    assert rejection is not None and reason in rejection


def test_a_slightly_perturbed_kernel_is_still_admitted(monkeypatch):
    net, inputs = _network_and_inputs(vgg_like(width=4), 16)
    monkeypatch.setattr(
        register_cuda, "conv", lambda *a, **k: _emulated_register_conv(*a, **k) * (1 + AGREEMENT_RTOL / 10)
    )
    step = next(s for s in net.steps if isinstance(s, SparseConvStep))
    assert KernelTuner(net).rejection(step, inputs[step.name], "register") is None


def test_a_kernel_that_cannot_run_is_rejected_with_the_exception(monkeypatch):
    net, inputs = _network_and_inputs(vgg_like(width=4), 16)

    def broken(*args, **kwargs):
        raise RuntimeError("NVRTC: unsupported option")

    monkeypatch.setattr(register_cuda, "conv", broken)
    step = next(s for s in net.steps if isinstance(s, SparseConvStep))
    assert KernelTuner(net).rejection(step, inputs[step.name], "register") == "RuntimeError: NVRTC: unsupported option"


def _cudnn_convolution_add_relu(x, weight, z, alpha, bias, stride, padding, dilation, groups):
    """What cuDNN's fused call computes, in plain PyTorch (the op itself runs on CUDA only)."""
    y = F.conv2d(x, weight, bias, stride=stride, padding=padding, dilation=dilation, groups=groups)
    return (y + alpha * z).relu() if z is not None else y.relu()


@pytest.mark.parametrize("fails", [False, True])
def test_the_fused_dense_kernel_passes_the_layer_geometry_and_residual_and_is_checked(monkeypatch, fails):
    """`"dense-fused"` calls cuDNN's conv + bias (+ residual) + ReLU in one op: with the op standing in as plain
    PyTorch, every ReLU layer of a residual network agrees with its reference; an op that raises is rejected."""

    def fused(*args):
        if fails:
            raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED")
        return _cudnn_convolution_add_relu(*args)

    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", fused)
    monkeypatch.setattr(torch, "cudnn_convolution_relu", lambda x, w, b, *rest: fused(x, w, None, 1.0, b, *rest))
    net, inputs = _network_and_inputs(ResNetLike(BasicBlock, (1, 1)), 16)
    steps = [s for s in net.steps if isinstance(s, SparseConvStep) and s.relu]
    assert any(s.residual for s in steps) and any(s.weights.geometry.stride != (1, 1) for s in steps)
    for step in steps:
        step.dense_weight = step.weights.to_dense()
        rejection = KernelTuner(net).rejection(step, inputs[step.name], "dense-fused")
        assert rejection == ("RuntimeError: CUDNN_STATUS_NOT_SUPPORTED" if fails else None), step.name


def test_every_registered_kernel_is_timed_and_the_fastest_register_plan_is_kept(
    overflowed_shared_memory_kernel, monkeypatch
):
    """`time_conv_kernels` on the CPU, with the device timer standing in: every registered kernel that can serve
    the layer is timed under its name, the register kernel's fastest plan becomes the layer's, and the dense
    copy is prepared for cuDNN's search at the sample's shape."""
    from types import SimpleNamespace

    from tendril.sparse import tuning
    from tendril.sparse.ops.conv import registry
    from tendril.sparse.ops.conv.ell import dataflow as ell_dataflow

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch, "cudnn_convolution_add_relu", _cudnn_convolution_add_relu)
    monkeypatch.setattr(
        torch, "cudnn_convolution_relu", lambda x, w, b, *rest: _cudnn_convolution_add_relu(x, w, None, 1.0, b, *rest)
    )
    monkeypatch.setattr(CartesianTritonKernel, "convolve", lambda self, step, acts, init, state: init)
    timings = iter(range(1000, 0, -1))  # every later variant measures faster

    def device_ms(run, reps):
        run()
        return float(next(timings))

    monkeypatch.setattr(tuning, "device_ms", device_ms)
    net, inputs = _network_and_inputs(ResNetLike(BasicBlock, (1, 1)), 16)
    step = next(s for s in net.steps if isinstance(s, SparseConvStep) and s.relu)
    step.register = None
    plans = KernelTuner(net).plans_for(step)
    assert len(plans) > 1
    times = KernelTuner(net).time_conv_kernels(step, inputs[step.name], reps=1)
    assert list(times) == ["cuda", "triton", "register", "ell", *registry.dense_kernels_for(step)]
    assert set(registry.dense_kernels_for(step)) == set(registry.DENSE_KERNELS)
    assert step.register is not None and step.register.plan == plans[-1]
    assert step.ell is not None and step.ell.config == ell_dataflow.configs_for(step)[-1]
    assert step.dense_weight is not None and step.benchmarked_shape == (1, *inputs[step.name][0][0].shape)
    assert not net.rejected_kernels


def test_the_registry_names_every_kernel_once_and_each_copy_is_a_layer_attribute():
    from dataclasses import fields

    from tendril.sparse.ops.conv import registry

    assert [k.name for k in registry.KERNELS] == ["cuda", "triton", "register", "ell", "dense", "dense-fused", "gemm"]
    assert registry.CHECKED_KERNELS == ("register", "ell", "dense", "dense-fused", "gemm")
    assert registry.WEIGHT_COPIES == ("tiled", "register", "ell", "dense_weight")
    assert set(registry.WEIGHT_COPIES) <= {f.name for f in fields(SparseConvStep)}
    assert registry.kernel_for("cuda", "register") is registry.BY_NAME["register"]
    assert registry.kernel_for("triton", "register").name == "triton"
    with pytest.raises(ValueError, match="conv kernel 'nope'"):
        registry.kernel_for("cuda", "nope")
