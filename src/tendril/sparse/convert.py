"""`convert(model, example_input)`: a torchvision-style CNN -> `SparseNetwork`.

The model is traced with `torch.fx` and its shapes propagated with the example input; each node
becomes a step. Supported: Conv2d (any kernel size, stride, padding, groups; dilation 1), Linear,
ReLU, MaxPool2d / AvgPool2d / AdaptiveAvgPool2d, BatchNorm2d directly after a Conv2d (folded into
its weights and bias), residual adds, flatten / view / reshape, Dropout and Identity (eval: no-ops).
Anything else raises `UnsupportedLayerError` naming the layer.

Fusions (each only where the intermediate value has no other user): BatchNorm into the conv before
it; a residual add into the conv producing one of its operands (its accumulator starts at bias +
the other operand); a ReLU into the conv or linear layer before it. A fused step runs where the last
node it absorbed stood, so every operand (e.g. a ResNet downsample branch traced after the main
branch) exists by then.

Precision: the network takes the dtype of the example input (fp32, fp16 or bf16), which must be the model's
parameters' dtype. BatchNorm is folded in fp32, then weights and bias are rounded once to the network's dtype;
kernels accumulate in fp32 and output that dtype.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from tendril.sparse.activations import ActivationLayout
from tendril.sparse.format import ConvGeometry, SparseConvWeights, SparseLinearWeights
from tendril.sparse.network import SparseNetwork
from tendril.sparse.ops import cpu_pool
from tendril.sparse.ops.conv import registry
from tendril.sparse.ops.conv.cartesian_cuda.dataflow import CARTESIAN_CUDA
from tendril.sparse.steps import DenseStep, SparseConvStep, SparseLinearStep, Step
from tendril.sparse.validation import VALUE_DTYPES


class UnsupportedLayerError(ValueError):
    pass


_POOLS = (nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Flatten)
_NO_OPS = (nn.Dropout, nn.Identity)
_RELUS = {torch.relu, F.relu}
_ADDS = {operator.add, operator.iadd, torch.add}
_DENSE_FUNCTIONS = {torch.flatten, F.max_pool2d, F.avg_pool2d, F.adaptive_avg_pool2d}
_DENSE_METHODS = {"flatten", "view", "reshape", "size", "contiguous"}


@dataclass
class _SparseBuilder:
    """A conv or linear layer being built: dense weights until fusion is over, then compressed."""

    name: str
    module: nn.Conv2d | nn.Linear
    input: str
    output: str
    tail: str
    """The last node absorbed into this layer; its value is this layer's output."""
    position: int
    weight: torch.Tensor
    bias: torch.Tensor
    in_hw: tuple[int, int] = (1, 1)
    relu: bool = False
    residual: str | None = None

    def build(self, capacity: float, dtype: torch.dtype) -> Step:
        """The layer's step, its weights and bias rounded to the network's `dtype`."""
        bias = self.bias.to(dtype)
        if isinstance(self.module, nn.Conv2d):
            geometry = ConvGeometry.of(self.module, self.in_hw)
            inputs = [self.input] if self.residual is None else [self.input, self.residual]
            weights = SparseConvWeights.from_dense(self.weight, geometry, dtype)
            step = SparseConvStep(
                self.name,
                inputs,
                self.output,
                weights,
                bias,
                ActivationLayout.for_conv(geometry, capacity),
                self.relu,
                self.residual is not None,
            )
            if weights.values.is_cuda and CARTESIAN_CUDA.unsupported_dtype(dtype) is None:
                step.tiled = CARTESIAN_CUDA.prepare(weights)  # the default kernel's copy: it runs until `tune` chooses
            elif weights.values.is_cuda:
                step.conv_kernel = registry.HALF_DEFAULT_KERNEL.name
            return step
        linear = SparseLinearWeights.from_dense(self.weight, dtype)
        layout = ActivationLayout.for_vector(linear.in_features, capacity)
        return SparseLinearStep(self.name, [self.input], self.output, linear, bias, layout, self.relu)


def _fold_batchnorm(layer: _SparseBuilder, bn: nn.BatchNorm2d) -> None:
    if bn.running_mean is None or bn.running_var is None:
        raise UnsupportedLayerError(f"BatchNorm2d {layer.name}: needs running statistics (track_running_stats=True)")
    scale = torch.rsqrt(bn.running_var.float() + bn.eps)
    if bn.weight is not None:
        scale = scale * bn.weight.float()
    shift = -bn.running_mean.float() * scale
    if bn.bias is not None:
        shift = shift + bn.bias.float()
    layer.weight = layer.weight * scale.view(-1, 1, 1, 1)
    layer.bias = layer.bias * scale + shift


class _Converter:
    def __init__(self, gm: fx.GraphModule, capacity: float, dtype: torch.dtype) -> None:
        self.gm = gm
        self.dtype = dtype
        self.modules = dict(gm.named_modules())
        self.capacity = capacity
        self.alias: dict[str, str] = {}
        self.layer_of_tail: dict[str, _SparseBuilder] = {}
        self.entries: list[tuple[int, _SparseBuilder | Step]] = []
        self.input_name = ""
        self.output_name = ""

    def value(self, node: Any) -> str:
        return self.alias.get(node.name, node.name)

    def fusable(self, node: Any) -> _SparseBuilder | None:
        """The sparse layer whose output `node` is, if nothing else reads that output."""
        if not isinstance(node, fx.Node) or len(node.users) != 1:
            return None
        return self.layer_of_tail.get(node.name)

    def absorb(self, layer: _SparseBuilder, node: fx.Node, position: int) -> None:
        del self.layer_of_tail[layer.tail]
        layer.tail, layer.position = node.name, position
        self.layer_of_tail[node.name] = layer
        self.alias[node.name] = layer.output

    def dense(self, node: fx.Node, position: int, fn: Callable[..., torch.Tensor]) -> None:
        inputs = [a for a in node.args if isinstance(a, fx.Node)]
        if any(isinstance(a, fx.Node) for a in node.kwargs.values()):
            raise UnsupportedLayerError(f"{node.format_node()}: tensor keyword arguments are not supported")
        slots = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
        template, kwargs = list(node.args), dict(node.kwargs)

        def call(*values: Any) -> Any:
            args = list(template)
            for i, v in zip(slots, values, strict=True):
                args[i] = v
            return fn(*args, **kwargs)

        self.entries.append((position, DenseStep(node.name, [self.value(a) for a in inputs], node.name, call)))

    def run(self) -> SparseNetwork:
        for position, node in enumerate(self.gm.graph.nodes):
            if node.op == "placeholder":
                if self.input_name:
                    raise UnsupportedLayerError("the model takes more than one input; convert handles one image tensor")
                self.input_name = node.name
            elif node.op == "output":
                if not isinstance(node.args[0], fx.Node):
                    raise UnsupportedLayerError("the model must return a single tensor")
                self.output_name = self.value(node.args[0])
            elif node.op == "call_module":
                self.module_node(node, position)
            elif node.op == "call_function":
                self.function_node(node, position)
            elif node.op == "call_method":
                self.method_node(node, position)
            else:
                raise UnsupportedLayerError(f"{node.format_node()}: {node.op} nodes are not supported")
        ordered = sorted(
            ((layer.position if isinstance(layer, _SparseBuilder) else position), i, layer)
            for i, (position, layer) in enumerate(self.entries)
        )
        steps = [e.build(self.capacity, self.dtype) if isinstance(e, _SparseBuilder) else e for _, _, e in ordered]
        device = next((p.device for p in self.gm.parameters()), torch.device("cpu"))
        return SparseNetwork(steps, self.input_name, self.output_name, device, self.dtype)

    def module_node(self, node: fx.Node, position: int) -> None:
        module = self.modules[str(node.target)]
        (source,) = node.args
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            shape = source.meta["tensor_meta"].shape  # type: ignore[union-attr]
            bias = module.bias.detach().float() if module.bias is not None else None
            weight = module.weight.detach().float()
            out_features = weight.shape[0]
            layer = _SparseBuilder(
                name=str(node.target),
                module=module,
                input=self.value(source),
                output=node.name,
                tail=node.name,
                position=position,
                weight=weight,
                bias=bias if bias is not None else torch.zeros(out_features, device=weight.device),
                in_hw=(int(shape[-2]), int(shape[-1])) if isinstance(module, nn.Conv2d) else (1, 1),
            )
            if isinstance(module, nn.Linear) and len(shape) != 2:
                raise UnsupportedLayerError(f"Linear {node.target}: input of shape {tuple(shape)}; flatten it to 2-D")
            self.layer_of_tail[node.name] = layer
            self.entries.append((position, layer))
        elif isinstance(module, nn.BatchNorm2d):
            conv = self.fusable(source)
            if conv is None or not isinstance(conv.module, nn.Conv2d) or conv.relu or conv.residual:
                raise UnsupportedLayerError(
                    f"BatchNorm2d {node.target} does not directly follow a Conv2d whose output it alone reads; "
                    "only BatchNorm folded into the preceding convolution is supported"
                )
            _fold_batchnorm(conv, module)
            self.absorb(conv, node, position)
        elif isinstance(module, nn.ReLU):
            self.relu(node, source, position)
        elif isinstance(module, _NO_OPS):
            self.alias[node.name] = self.value(source)
        elif isinstance(module, _POOLS):
            self.dense(node, position, cpu_pool.pooling(module))
        else:
            raise UnsupportedLayerError(
                f"layer {node.target!r} ({type(module).__name__}) is not supported by tendril.sparse.convert; "
                "supported: Conv2d, Linear, ReLU, BatchNorm2d after Conv2d, MaxPool2d, AvgPool2d, "
                "AdaptiveAvgPool2d, Flatten, Dropout, Identity, residual adds"
            )

    def relu(self, node: fx.Node, source: Any, position: int) -> None:
        layer = self.fusable(source)
        if layer is not None and not layer.relu:
            layer.relu = True
            self.absorb(layer, node, position)
        else:
            self.dense(node, position, _relu)

    def function_node(self, node: fx.Node, position: int) -> None:
        target = node.target
        if target in _RELUS:
            self.relu(node, node.args[0], position)
        elif target in _ADDS:
            self.add(node, position)
        elif target is F.dropout:
            self.alias[node.name] = self.value(node.args[0])
        elif target in _DENSE_FUNCTIONS:
            self.dense(node, position, target)
        else:
            raise UnsupportedLayerError(
                f"function {getattr(target, '__name__', target)} ({node.name}) is not supported"
            )

    def add(self, node: fx.Node, position: int) -> None:
        a, b = node.args[:2]
        if len(node.args) > 2 or node.kwargs or not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            raise UnsupportedLayerError(f"{node.format_node()}: only the sum of two tensors is supported")
        for main, other in ((a, b), (b, a)):
            layer = self.fusable(main)
            same_shape = main.meta["tensor_meta"].shape == other.meta["tensor_meta"].shape
            if layer and isinstance(layer.module, nn.Conv2d) and not layer.relu and not layer.residual and same_shape:
                if other is main:  # `y + y`: the residual would be the layer's own output
                    break
                layer.residual = self.value(other)
                self.absorb(layer, node, position)
                return
        self.dense(node, position, torch.add)

    def method_node(self, node: fx.Node, position: int) -> None:
        method = str(node.target)
        if method == "relu":
            self.relu(node, node.args[0], position)
        elif method in ("add", "add_", "__iadd__"):
            self.add(node, position)
        elif method in _DENSE_METHODS:
            self.dense(node, position, lambda x, *args, **kwargs: getattr(x, method)(*args, **kwargs))
        else:
            raise UnsupportedLayerError(f"tensor method {method!r} ({node.name}) is not supported")


def _relu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """A ReLU that is not fused into a layer (`F.relu`'s `inplace` accepted: the network never writes its input)."""
    return torch.relu(x)


def _check_eval_mode(model: nn.Module) -> None:
    """Every module must be in eval mode: a submodule left in training mode (BatchNorm on batch statistics, active
    dropout) computes what the network's folded, eval-mode layers do not."""
    training = [name or type(module).__name__ for name, module in model.named_modules() if module.training]
    if training:
        raise ValueError(
            f"convert needs an eval-mode model (dropout and batch norm behave differently in training); in training "
            f"mode: {', '.join(training[:5])}{' ...' if len(training) > 5 else ''} (call model.eval())"
        )


def _check_model_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter and buffer of `model` must be in the network's `dtype` (the example input's):
    a mismatch would convert silently at one precision and run at another."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, t in tensors:
        if t.is_floating_point() and t.dtype != dtype:
            raise ValueError(
                f"example_input is {dtype} but the model's {name} is {t.dtype}: convert a model and an example "
                "input of one dtype (e.g. model.half() with x.half())"
            )


def convert(
    model: nn.Module,
    example_input: torch.Tensor,
    *,
    activation_capacity: float = 1.0,
    tune: bool = True,
    pixel_runs: bool = True,
    dense_fallback: bool = True,
) -> SparseNetwork:
    """Turn an eval-mode CNN into a `SparseNetwork` for inputs shaped like `example_input` ([N, C, H, W]).

    Zero weights (e.g. from `tendril.sparse.prune`) are dropped; the network runs on the device of the
    model's parameters. It holds its own compressed copies of the weights, so later changes to the model's weights
    do not reach it: convert again. `activation_capacity` is the fraction of each activation plane the compressed
    buffers can hold (1.0, the default, can never overflow). On a GPU, `tune` times both convolution
    kernels on every layer with `example_input` and keeps the faster (`SparseNetwork.tune`); on the CPU backend it
    times forwards with and without the library's product for 1×1 layers (`SparseNetwork.cpu_library`). An
    overflow of a reduced capacity while tuning is not reported (it concerns the example only).
    `pixel_runs=False` keeps `tune` from timing the register-tiled kernel's 1×1 pixel-run plans
    (`SparseNetwork.pixel_runs`); `dense_fallback=False` keeps it from running a convolution densely (cuDNN, cuBLAS)
    where that measures faster than the sparse kernels (`SparseNetwork.dense_fallback`).

    The network's dtype is `example_input`'s: float32, float16 or bfloat16 (`convert(model.half(), x.half())`),
    and must be that of the model's floating-point parameters and buffers. Half networks run on the GPU (the CPU
    backend is fp32 only; see `tendril.sparse.network`).
    """
    _check_eval_mode(model)
    if example_input.dim() != 4 or example_input.dtype not in VALUE_DTYPES:
        raise ValueError(
            f"example_input: expected a float32, float16 or bfloat16 [N, C, H, W] tensor, got {example_input.dtype} "
            f"{tuple(example_input.shape)}"
        )
    _check_model_dtype(model, example_input.dtype)
    try:
        gm = fx.symbolic_trace(model)
    except Exception as error:
        raise UnsupportedLayerError(
            f"torch.fx could not trace the model ({error}); convert needs a traceable CNN"
        ) from error
    with torch.no_grad():  # the network's weights and biases carry no autograd history of the model's parameters
        ShapeProp(gm).propagate(example_input)
        network = _Converter(gm, activation_capacity, example_input.dtype).run()
    network.pixel_runs = pixel_runs
    network.dense_fallback = dense_fallback
    if tune and network.device.type == "cuda":
        network.tune(example_input[:1].to(network.device))
        network.reset_overflow()
    elif tune and network.backend == "cpu":
        network.tune(example_input)
        network.reset_overflow()
    return network
