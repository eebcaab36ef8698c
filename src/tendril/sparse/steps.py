"""The steps of a converted sparse CNN: sparse convolution and linear layers, and dense PyTorch ops.

Between layers activations are dense `[N, C, H, W]` tensors (SCNN keeps accumulators dense until
ReLU); each sparse layer compresses its own input for its own geometry (padding and stride phases),
multiplies compressed weights by compressed activations, and accumulates into a dense output that
starts as bias (+ the residual, when a residual add was fused into it), then applies ReLU in place
when one was fused. Pooling, flatten and unfused ReLU/adds run as dense PyTorch ops (`DenseStep`): on
dense tensors they are single cheap passes, while a compressed version would need irregular gathers.

A step runs under a `RunState` (backend, threads, overflow flag, last nonzero counts; see
`tendril.sparse.network` for the backends). A batch is run one sample at a time (the engine is built
for batch-1 latency), except by cuDNN and cuBLAS, which take it whole; a batch of one is a view of the
sample's output, not a copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tendril.sparse.format import (
    ActivationLayout,
    CompressedActivations,
    CsrLinearWeights,
    SparseConvWeights,
    SparseLinearWeights,
)
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.compress import triton as compress_triton
from tendril.sparse.ops.conv import cpu as conv_cpu
from tendril.sparse.ops.conv import cuda as conv_cuda
from tendril.sparse.ops.conv import gemm as conv_gemm
from tendril.sparse.ops.conv import register_cuda
from tendril.sparse.ops.conv import triton as conv_triton
from tendril.sparse.ops.conv.tiling import TiledWeights
from tendril.sparse.ops.linear import cpu as linear_cpu
from tendril.sparse.ops.linear import triton as linear_triton


@dataclass
class RunState:
    """What one forward shares between steps: backend, threads, the overflow flag, the last counts."""

    backend: str
    threads: int
    overflow: torch.Tensor
    last_counts: dict[str, torch.Tensor] = field(default_factory=dict)
    count_inputs: bool = False
    """Whether the layers whose kernels do not count their input's nonzeros on the way (dense fallbacks, the FC
    row kernel) count them with extra small kernels (for `SparseNetwork.layers`; off in plain forwards)."""

    def compress(self, step: str, x: torch.Tensor, layout: ActivationLayout) -> CompressedActivations:
        if self.backend in ("cuda", "triton"):
            acts = compress_triton.compress(x, layout, self.overflow)
        else:
            acts = compress_cpu.compress(x, layout, threads=self.threads)
            self.overflow |= (acts.counts > layout.capacity).any().to(torch.int32)
        self.last_counts[step] = acts.counts
        return acts

    def count(self, step: str, counts: torch.Tensor, layout: ActivationLayout) -> None:
        """Record the true nonzero counts a CPU kernel found in a step's dense input (the CPU steps
        compress only when a layer uses SCNN's dataflow, but a capacity too small is reported alike)."""
        self.overflow |= (counts > layout.capacity).any().to(torch.int32)
        self.last_counts[step] = counts


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
    conv_kernel: str = "cuda"
    """Under the `"cuda"` backend, which convolution kernel this layer uses (`SparseNetwork.tune` picks):
    `"cuda"`, `"triton"`, `"register"`, or one of `DENSE_KERNELS` (fp32 cuDNN or cuBLAS on the pruned weights,
    where it measured faster than every sparse kernel; see `run_dense`)."""
    dense_weight: torch.Tensor | None = None
    """The pruned weights as a dense tensor, kept only for the dense kernels."""
    benchmarked_shape: tuple[int, ...] | None = None
    """The input shape `tune` ran the dense kernels at with cuDNN's benchmark mode (the search runs eagerly there):
    inputs of this shape use the measured algorithm, others cuDNN's heuristic (no search inside a graph capture)."""
    register: register_cuda.RegisterConvLayer | None = None
    """The weights and buffers of the register-tiled kernel (built by `tune` where it supports the layer)."""
    cpu_plan: conv_cpu.CpuConvPlan | None = None
    """The weights re-ordered for the CPU kernels (built on the first CPU forward)."""

    def held_bytes(self, in_use_only: bool = False) -> int:
        """Weight bytes this layer holds: compressed weights and bias, and each GPU kernel's copy of the weights
        held now (not the kernels' workspaces, nor the CPU plan); `in_use_only`: only the copy the chosen kernel
        reads (what `release_unused` leaves)."""
        copies = {
            "tiled": self.tiled,
            "register": None if self.register is None else self.register.weights,
            "dense_weight": self.dense_weight,
        }
        unused = self._unused_copies() if in_use_only else ()
        return _held_bytes(self.weights, self.bias, *(copy for name, copy in copies.items() if name not in unused))

    def release_unused(self) -> None:
        """Drop the kernel copies the chosen kernel does not read."""
        for name in self._unused_copies():
            setattr(self, name, None)
        if self.dense_weight is None:
            self.benchmarked_shape = None

    def _unused_copies(self) -> tuple[str, ...]:
        reads = {"cuda": "tiled", "register": "register", **dict.fromkeys(DENSE_KERNELS, "dense_weight")}
        return tuple(name for name in ("tiled", "register", "dense_weight") if reads.get(self.conv_kernel) != name)

    def convolve(self, acts: CompressedActivations, init: torch.Tensor, state: RunState) -> torch.Tensor:
        if state.backend == "cuda" and self.conv_kernel == "cuda":
            if self.tiled is None:
                raise ValueError(
                    f"{self.name}: the cuda kernel's tile-ordered weights are not held (a CPU conversion, or "
                    "released by SparseNetwork.release_unused_kernels)"
                )
            return conv_cuda.conv(acts, self.weights, self.tiled, init, relu=self.relu)
        if state.backend == "cpu":
            if self.cpu_plan is None:
                self.cpu_plan = conv_cpu.CpuConvPlan.prepare(self.weights)
            y = conv_cpu.conv(acts, self.weights, init, threads=state.threads, plan=self.cpu_plan)
        else:
            y = conv_triton.conv(acts, self.weights, init)
        return y.relu_() if self.relu else y

    def reference(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        """The layer's exact output in float64: dense `F.conv2d` on the same pruned weights, plus bias,
        the residual and ReLU as fused here (what every kernel must agree with)."""
        g = self.weights.geometry
        y = F.conv2d(
            values[0].double(),
            self.weights.to_dense().double(),
            self.bias.double(),
            stride=g.stride,
            padding=g.padding,
            groups=g.groups,
        )
        if self.residual:
            y = y + values[1].double()
        return y.relu() if self.relu else y

    def run(self, values: Sequence[torch.Tensor], state: RunState) -> torch.Tensor:
        x = values[0]
        g = self.weights.geometry
        if state.backend == "cpu":
            return self._run_cpu(x, values[1] if self.residual else None, state)
        if state.backend == "cuda" and self.conv_kernel == "register":
            return self._run_register(x, values[1] if self.residual else None, state)
        if state.backend == "cuda" and self.conv_kernel in DENSE_KERNELS:
            return self.run_dense(x, values[1] if self.residual else None, state)
        outputs = []
        for b in range(x.shape[0]):
            acts = state.compress(self.name, x[b], self.layout)
            init = self.bias.view(-1, 1, 1).expand(g.out_channels, *g.out_hw)
            init = (init + values[1][b]) if self.residual else init.contiguous()
            outputs.append(self.convolve(acts, init, state))
        return _batched(outputs)

    def _run_register(self, x: torch.Tensor, residual: torch.Tensor | None, state: RunState) -> torch.Tensor:
        """The register-tiled kernel reads the dense input (no compression, so no capacity to overflow)
        and fuses bias, residual and ReLU; the input's nonzero count comes from the kernel's tile counts."""
        if self.register is None:
            raise ValueError(
                f"{self.name}: the register kernel was chosen but not prepared; SparseNetwork.tune builds it"
            )
        outputs = []
        for b in range(x.shape[0]):
            resid = None if residual is None else residual[b].contiguous()
            y = register_cuda.conv(x[b].contiguous(), self.register, self.bias, residual=resid, relu=self.relu)
            outputs.append(y)
            state.last_counts[self.name] = self.register.counts
        return _batched(outputs)

    def run_dense(self, x: torch.Tensor, residual: torch.Tensor | None, state: RunState) -> torch.Tensor:
        """cuDNN on the dense pruned weights, in full fp32 (never TF32), the whole batch at once, with the algorithm
        cuDNN measured fastest at `tune` (`benchmarked_shape`). `"dense"`: the convolution with bias, then the
        residual and ReLU as PyTorch ops; `"dense-fused"` (layers with a fused ReLU): one cuDNN call for all of it
        (`cudnn_convolution_relu` / `_add_relu`); `"gemm"`: one cuBLAS product and a fused epilogue
        (`tendril.sparse.ops.conv.gemm`)."""
        if self.dense_weight is None:
            raise ValueError(f"{self.name}: the dense kernel was chosen but not prepared; SparseNetwork.tune builds it")
        g = self.weights.geometry
        if state.count_inputs:
            state.last_counts[self.name] = torch.count_nonzero(x[-1]).view(1)
        dilation = (1, 1)
        with fp32_dense_math(benchmark=tuple(x.shape) == self.benchmarked_shape):
            if self.conv_kernel == "gemm":
                return conv_gemm.conv(x, self.dense_weight, self.bias, g, residual=residual, relu=self.relu)
            if self.conv_kernel == "dense-fused" and residual is not None:
                return torch.cudnn_convolution_add_relu(
                    x, self.dense_weight, residual, 1.0, self.bias, g.stride, g.padding, dilation, g.groups
                )
            if self.conv_kernel == "dense-fused":
                return torch.cudnn_convolution_relu(
                    x, self.dense_weight, self.bias, g.stride, g.padding, dilation, g.groups
                )
            y = F.conv2d(x, self.dense_weight, self.bias, stride=g.stride, padding=g.padding, groups=g.groups)
        if residual is not None:
            y.add_(residual)
        return y.relu_() if self.relu else y

    def _run_cpu(self, x: torch.Tensor, residual: torch.Tensor | None, state: RunState) -> torch.Tensor:
        """The CPU kernels read the dense input and fuse bias, residual and ReLU (`conv_dense_input`)."""
        if self.cpu_plan is None:
            self.cpu_plan = conv_cpu.CpuConvPlan.prepare(self.weights)
        g = self.weights.geometry
        y = torch.empty(x.shape[0], g.out_channels, *g.out_hw)
        for b in range(x.shape[0]):
            counts = conv_cpu.conv_dense_input(
                x[b],
                self.cpu_plan,
                self.bias,
                out=y[b],
                layout=self.layout,
                residual=None if residual is None else residual[b],
                relu=self.relu,
                threads=state.threads,
            )
            state.count(self.name, counts, self.layout)
        return y


DENSE_KERNELS = ("dense", "dense-fused", "gemm")
CHECKED_KERNELS = ("register", *DENSE_KERNELS)
"""Candidates `tune` admits only once the layer's output agrees with its float64 dense reference."""


def dense_kernels_for(step: SparseConvStep) -> tuple[str, ...]:
    """The dense kernels that can serve `step`: cuDNN fuses only a ReLU (with the residual); the GEMM takes no
    groups."""
    fused = ("dense-fused",) if step.relu else ()
    gemm = ("gemm",) if conv_gemm.supports(step.weights.geometry) else ()
    return ("dense", *fused, *gemm)


def _held_bytes(*objects: object) -> int:
    """Bytes of the distinct tensors `objects` hold, through nested dataclasses (a tensor two of them share counts
    once)."""
    tensors: dict[tuple[torch.device, int], int] = {}

    def visit(obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            tensors[(obj.device, obj.data_ptr())] = obj.nbytes
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                visit(getattr(obj, f.name))

    for obj in objects:
        visit(obj)
    return sum(tensors.values())


def _batched(samples: list[torch.Tensor]) -> torch.Tensor:
    """One output per sample stacked into a batch (a view, not a copy, for the batch of one the engine is built for)."""
    return samples[0].unsqueeze(0) if len(samples) == 1 else torch.stack(samples)


@contextlib.contextmanager
def fp32_dense_math(benchmark: bool = False) -> Iterator[None]:
    """cuDNN convolutions and cuBLAS matrix products in full fp32 inside the block (PyTorch lets convolutions, and
    a user's setting matrix products, use TF32); `benchmark`: with the algorithm cuDNN measured fastest for each
    shape (`torch.backends.cudnn.benchmark`), not its heuristic's."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    previous = cudnn.allow_tf32, cudnn.benchmark, matmul.allow_tf32
    cudnn.allow_tf32, cudnn.benchmark, matmul.allow_tf32 = False, benchmark, False
    try:
        yield
    finally:
        cudnn.allow_tf32, cudnn.benchmark, matmul.allow_tf32 = previous


@dataclass
class SparseLinearStep:
    name: str
    inputs: list[str]
    output: str
    weights: SparseLinearWeights
    bias: torch.Tensor
    layout: ActivationLayout
    relu: bool
    fc_kernel: str = "spmspv"
    """Under the `"cuda"` backend: `"spmspv"` (compressed activations × CSC weights, atomics) or `"rows"` (dense
    input × a CSR copy of the weights, `linear_triton.linear_rows`), whichever `SparseNetwork.tune` measured faster."""
    csr: CsrLinearWeights | None = None
    """The CSR copy, kept only for the `"rows"` kernel."""
    rows_config: linear_triton.RowsConfig = linear_triton.DEFAULT_ROWS_CONFIG
    """The row kernel's launch configuration (`SparseNetwork.tune` times `linear_triton.ROWS_CONFIGS`)."""

    def held_bytes(self, in_use_only: bool = False) -> int:
        """Bytes this layer holds: compressed weights and bias, and the row kernel's CSR copy if held (and, with
        `in_use_only`, the row kernel is chosen)."""
        csr = None if in_use_only and self.fc_kernel != "rows" else self.csr
        return _held_bytes(self.weights, self.bias, csr)

    def release_unused(self) -> None:
        if self.fc_kernel != "rows":
            self.csr = None

    def run(self, values: Sequence[torch.Tensor], state: RunState) -> torch.Tensor:
        x = values[0]
        if x.dim() != 2 or x.shape[1] != self.weights.in_features:
            raise ValueError(f"{self.name}: expected input [N, {self.weights.in_features}], got {tuple(x.shape)}")
        if state.backend == "cpu":
            y = torch.empty(x.shape[0], self.weights.out_features)
            for b in range(x.shape[0]):
                counts = linear_cpu.linear_dense_input(
                    x[b], self.weights, self.bias, out=y[b], relu=self.relu, threads=state.threads
                )
                state.count(self.name, counts, self.layout)
            return y
        outputs = []
        for b in range(x.shape[0]):
            if state.backend == "cuda" and self.fc_kernel == "rows":
                if self.csr is None:
                    raise ValueError(f"{self.name}: the rows kernel was chosen but not prepared (SparseNetwork.tune)")
                y = linear_triton.linear_rows(
                    x[b].contiguous(), self.csr, self.bias, relu=self.relu, config=self.rows_config
                )
                outputs.append(y)
                if state.count_inputs:
                    state.last_counts[self.name] = torch.count_nonzero(x[b]).view(1)
                continue
            acts = state.compress(self.name, x[b].reshape(1, 1, -1), self.layout)
            y = linear_triton.linear(acts, self.weights, self.bias.clone())
            outputs.append(y.relu_() if self.relu else y)
        return _batched(outputs)


@dataclass
class DenseStep:
    name: str
    inputs: list[str]
    output: str
    fn: Callable[..., torch.Tensor]

    def run(self, values: Sequence[torch.Tensor], state: RunState) -> torch.Tensor:
        return self.fn(*values)


Step = SparseConvStep | SparseLinearStep | DenseStep

