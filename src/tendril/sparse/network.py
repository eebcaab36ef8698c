"""A converted sparse CNN: a straight-line plan of steps over named dense activations.

Between layers activations are dense `[N, C, H, W]` tensors (SCNN keeps accumulators dense until
ReLU); each sparse layer compresses its own input for its own geometry (padding and stride phases),
multiplies compressed weights by compressed activations, and accumulates into a dense output that
starts as bias (+ the residual, when a residual add was fused into it), then applies ReLU in place
when one was fused. Pooling, flatten and unfused ReLU/adds run as dense PyTorch ops: on dense
tensors they are single cheap passes, while a compressed version would need irregular gathers.

Backends: `"cuda"` (the default on a GPU: convolutions by the shared-memory CUDA C++ kernel, with
bias, residual and ReLU fused; compression and FC layers by Triton kernels), `"triton"` (every op a
Triton kernel, convolutions accumulating by global atomics; also runs on CPU tensors under
`TRITON_INTERPRET=1`) and `"cpu"` (the same algorithm vectorized with torch ops, on `threads`
worker threads). The GPU forwards never sync with the host: every buffer has a static size, nonzero counts stay on the device, overflow of a
reduced activation capacity raises a device flag that `check_overflow()` turns into an error after
the run. So a whole network replays inside one CUDA graph.

A batch is run one sample at a time (the engine is built for batch-1 latency).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tendril.sparse.format import ActivationLayout, CompressedActivations, SparseConvWeights, SparseLinearWeights
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.compress import triton as compress_triton
from tendril.sparse.ops.conv import cpu as conv_cpu
from tendril.sparse.ops.conv import cuda as conv_cuda
from tendril.sparse.ops.conv import triton as conv_triton
from tendril.sparse.ops.conv.tiling import TiledWeights
from tendril.sparse.ops.linear import cpu as linear_cpu
from tendril.sparse.ops.linear import triton as linear_triton

BACKENDS = ("cuda", "triton", "cpu")


class ActivationOverflowError(RuntimeError):
    pass


@dataclass
class RunState:
    """What one forward shares between steps: backend, threads, the overflow flag, the last counts."""

    backend: str
    threads: int
    overflow: torch.Tensor
    last_counts: dict[str, torch.Tensor] = field(default_factory=dict)

    def compress(self, step: str, x: torch.Tensor, layout: ActivationLayout) -> CompressedActivations:
        if self.backend in ("cuda", "triton"):
            acts = compress_triton.compress(x, layout, self.overflow)
        else:
            acts = compress_cpu.compress(x, layout)
            self.overflow |= (acts.counts > layout.capacity).any().to(torch.int32)
        self.last_counts[step] = acts.counts
        return acts


@dataclass
class SparseConvStep:
    name: str
    inputs: list[str]
    output: str
    weights: SparseConvWeights
    bias: torch.Tensor
    layout: ActivationLayout
    relu: bool
    residual: bool
    """When true, `inputs[1]` is added to the output before the ReLU (a fused residual add)."""
    tiled: TiledWeights | None = None
    """The weights in the CUDA kernel's tile order (GPU networks only)."""

    def run(self, values: Sequence[torch.Tensor], state: RunState) -> torch.Tensor:
        x = values[0]
        g = self.weights.geometry
        outputs = []
        for b in range(x.shape[0]):
            acts = state.compress(self.name, x[b], self.layout)
            init = self.bias.view(-1, 1, 1).expand(g.out_channels, *g.out_hw)
            init = (init + values[1][b]) if self.residual else init.contiguous()
            if state.backend == "cuda":
                if self.tiled is None:
                    raise ValueError(f"{self.name}: the cuda backend needs a network converted on a GPU")
                outputs.append(conv_cuda.conv(acts, self.weights, self.tiled, init, relu=self.relu))
                continue
            if state.backend == "triton":
                y = conv_triton.conv(acts, self.weights, init)
            else:
                y = conv_cpu.conv(acts, self.weights, init, threads=state.threads)
            outputs.append(y.relu_() if self.relu else y)
        return torch.stack(outputs)


@dataclass
class SparseLinearStep:
    name: str
    inputs: list[str]
    output: str
    weights: SparseLinearWeights
    bias: torch.Tensor
    layout: ActivationLayout
    relu: bool

    def run(self, values: Sequence[torch.Tensor], state: RunState) -> torch.Tensor:
        x = values[0]
        if x.dim() != 2 or x.shape[1] != self.weights.in_features:
            raise ValueError(f"{self.name}: expected input [N, {self.weights.in_features}], got {tuple(x.shape)}")
        outputs = []
        for b in range(x.shape[0]):
            acts = state.compress(self.name, x[b].reshape(1, 1, -1), self.layout)
            init = self.bias.clone()
            if state.backend in ("cuda", "triton"):
                y = linear_triton.linear(acts, self.weights, init)
            else:
                y = linear_cpu.linear(acts, self.weights, init, threads=state.threads)
            outputs.append(y.relu_() if self.relu else y)
        return torch.stack(outputs)


@dataclass
class DenseStep:
    name: str
    inputs: list[str]
    output: str
    fn: Callable[..., torch.Tensor]

    def run(self, values: Sequence[torch.Tensor], state: RunState) -> torch.Tensor:
        return self.fn(*values)


Step = SparseConvStep | SparseLinearStep | DenseStep


@dataclass(frozen=True)
class LayerReport:
    name: str
    kind: str
    weight_density: float
    activation_density: float | None
    """Fraction of nonzero input activations at the last forward (None before any forward)."""
    weight_bytes: int
    dense_weight_bytes: int


class SparseNetwork:
    """Runs a plan built by `tendril.sparse.convert`; call it like the model it came from."""

    def __init__(self, steps: list[Step], input_name: str, output_name: str, device: torch.device) -> None:
        self.steps = steps
        self.input_name = input_name
        self.output_name = output_name
        self.device = device
        self.backend = "cuda" if device.type == "cuda" else "cpu"
        self.threads = 1
        self._state = RunState(self.backend, self.threads, torch.zeros(1, dtype=torch.int32, device=device))

    def set_backend(self, backend: str, threads: int = 1) -> SparseNetwork:
        """Choose `"cuda"`, `"triton"` or `"cpu"` (with `threads` workers for the CPU backend)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: expected one of {BACKENDS}")
        if backend == "cpu" and self.device.type != "cpu":
            raise ValueError("the cpu backend needs a network converted on the CPU (convert a CPU copy of the model)")
        if backend == "cuda" and self.device.type != "cuda":
            raise ValueError("the cuda backend needs a network converted on a GPU")
        if threads < 1:
            raise ValueError(f"threads={threads}: expected at least 1")
        self.backend, self.threads = backend, threads
        self._state = RunState(backend, threads, self._state.overflow)
        return self

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device != self.device or x.dtype != torch.float32:
            raise ValueError(f"expected a float32 input on {self.device}, got {x.dtype} on {x.device}")
        values = {self.input_name: x}
        for step in self.steps:
            values[step.output] = step.run([values[name] for name in step.inputs], self._state)
        return values[self.output_name]

    __call__ = forward

    @torch.no_grad()
    def profile(self, x: torch.Tensor) -> list[tuple[str, float]]:
        """One forward timing each step (CUDA events on the GPU, wall clock on the CPU): `(step, ms)`."""
        values = {self.input_name: x}
        cuda = self.device.type == "cuda"
        marks: list[tuple[str, Any]] = []
        for step in self.steps:
            start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
            if cuda:
                start.record()
            values[step.output] = step.run([values[name] for name in step.inputs], self._state)
            if cuda:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                marks.append((step.name, (start, end)))
            else:
                marks.append((step.name, (time.perf_counter() - start) * 1e3))
        if cuda:
            torch.cuda.synchronize(self.device)
            return [(name, s.elapsed_time(e)) for name, (s, e) in marks]
        return marks

    def check_overflow(self) -> None:
        """Raise if any activation overflowed its capacity since the last check (host sync), then reset."""
        if bool(self._state.overflow.item()):
            self._state.overflow.zero_()
            raise ActivationOverflowError(
                "an activation had more nonzeros than its compressed capacity, so that forward's result is wrong; "
                "convert with a larger activation_capacity (1.0 can never overflow)"
            )

    def layers(self) -> list[LayerReport]:
        """Per sparse layer: weight and (last forward's) activation density, compressed and dense bytes."""
        reports = []
        for step in self.steps:
            if isinstance(step, DenseStep):
                continue
            counts = self._state.last_counts.get(step.name)
            dense_numel = step.layout.channels * step.layout.in_hw[0] * step.layout.in_hw[1]
            act = None if counts is None else float(counts.sum()) / dense_numel
            if isinstance(step, SparseConvStep):
                dense_w = step.weights.dense_numel
            else:
                dense_w = step.weights.in_features * step.weights.out_features
            bias_bytes = 4 * step.bias.numel()
            reports.append(
                LayerReport(
                    step.name,
                    "conv" if isinstance(step, SparseConvStep) else "linear",
                    step.weights.density,
                    act,
                    step.weights.nbytes + bias_bytes,
                    4 * dense_w + bias_bytes,
                )
            )
        return reports

    def weight_bytes(self) -> tuple[int, int]:
        """Total (compressed, dense fp32) weight bytes."""
        layers = self.layers()
        return sum(r.weight_bytes for r in layers), sum(r.dense_weight_bytes for r in layers)
