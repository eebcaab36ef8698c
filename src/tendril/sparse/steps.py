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
sample's output, not a copy. A convolution runs by the kernel its backend and `conv_kernel` name: one
`ConvKernel` per dataflow (`tendril.sparse.ops.conv.registry`).

A network's values (weights, bias, activations) are all in its dtype: fp32, fp16 or bf16. Kernels accumulate in
fp32 and return that dtype; a kernel that does not run it (`ConvKernel.dtypes`) raises rather than converting.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from tendril.sparse.activations import ActivationLayout, CompressedActivations
from tendril.sparse.format import CsrLinearWeights, SparseConvWeights, SparseLinearWeights
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.compress import triton as compress_triton
from tendril.sparse.ops.conv import registry
from tendril.sparse.ops.conv.cartesian_cuda.tiling import TiledWeights
from tendril.sparse.ops.conv.cpu.kernel import CpuConvPlan
from tendril.sparse.ops.conv.ell.packing import EllConvWeights
from tendril.sparse.ops.conv.interface import batched
from tendril.sparse.ops.conv.register.kernel import RegisterConvLayer
from tendril.sparse.ops.linear import cpu as linear_cpu
from tendril.sparse.ops.linear import triton as linear_triton

if TYPE_CHECKING:
    from tendril.sparse.ops.conv.cpu.prepared import PlanesOutput


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
    reused_outputs: frozenset[str] = frozenset()
    """The steps (by name) whose CPU calls may write their output into a buffer of their own that the next call
    overwrites: a network lists those whose output never reaches its caller (`SparseNetwork.forward` returns a
    tensor no later call writes). Every other step's CPU call returns a new tensor."""
    counted_outputs: frozenset[str] = frozenset()
    """The steps (by name, all in `reused_outputs`) whose CPU calls keep their output's nonzeros as their direct
    kernel writes it, for the next layers that read that output directly (`ops/conv/cpu/prepared.py`)."""
    output_counts: dict[str, tuple[torch.Tensor, np.ndarray]] = field(default_factory=dict)
    """Per activation name, the tensor a step of `counted_outputs` last wrote under it and that write's nonzeros per
    sample, band and channel (`[N, bands, C]`), while they describe it."""
    planes_readers: dict[str, SparseConvStep] = field(default_factory=dict)
    """Per step (by name, all in `reused_outputs`), the one convolution that reads its output, where that one's phase
    planes hold its input as is (`cpu_kernel.holds_input`): the step's CPU call at batch 1 may write its output
    straight into planes laid out as that reader's (`ops/conv/cpu/prepared.py`)."""
    output_planes: dict[str, PlanesOutput] = field(default_factory=dict)
    """Per activation name, the planes a step of `planes_readers` writes under it (and the tensor it returns)."""
    library: bool = True
    """Whether CPU calls on one thread run unpadded 1×1 layers as the library's sparse product (`spmm`) rather than the
    compiled loops (`SparseNetwork.cpu_library`)."""
    prepared: dict[int, Any] = field(default_factory=dict)
    """The CPU backend's prepared call of each step (by `id`; the call holds its step), built at the step's first
    call under this state (`ops/conv/cpu/prepared.py`, `linear_cpu.PreparedLinear`): a new state (a new backend or
    thread count) prepares anew. Its counts buffers are what `last_counts` holds for those steps. A prepared call
    reads the step's bias and CPU plan as they were at its first call: after replacing either, start a new state."""

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

    def count_host(self, step: str, counts: torch.Tensor, capacity: int | None) -> None:
        """`count` for the counts of a prepared CPU call, whose capacity it knows: None where no count can exceed
        it (the capacity is the whole plane), so that the comparison is skipped."""
        if capacity is not None and int(counts.max()) > capacity:
            self.overflow.fill_(1)
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
    conv_kernel: str = registry.DEFAULT_KERNEL.name
    """Under the `"cuda"` backend, which convolution kernel this layer uses (`SparseNetwork.tune` picks): a
    name in `ops.conv.registry.KERNELS`: `"cuda"`, `"triton"`, `"register"`, or one of `DENSE_KERNELS` (fp32
    cuDNN or cuBLAS on the pruned weights, where it measured faster than every sparse kernel)."""
    dense_weight: torch.Tensor | None = None
    """The pruned weights as a dense tensor, kept only for the dense kernels."""
    benchmarked_shape: tuple[int, ...] | None = None
    """The input shape `tune` ran the dense kernels at with cuDNN's benchmark mode (the search runs eagerly there):
    inputs of this shape use the measured algorithm, others cuDNN's heuristic (no search inside a graph capture)."""
    register: RegisterConvLayer | None = None
    """The weights and buffers of the register-tiled kernel (built by `tune` where it supports the layer)."""
    ell: EllConvWeights | None = None
    """The weights packed for the ELL kernel's chosen tile config (built by `tune`)."""
    cpu_plan: CpuConvPlan | None = None
    """The weights re-ordered for the CPU kernels (built on the first CPU forward)."""

    def held_bytes(self, in_use_only: bool = False) -> int:
        """Weight bytes this layer holds: compressed weights and bias, and each GPU kernel's copy of the weights
        held now (not the kernels' workspaces, nor the CPU plan); `in_use_only`: only the copy the chosen kernel
        reads (what `release_unused` leaves)."""
        unused = self._unused_copies() if in_use_only else ()
        copies = {k.reads: k.held_copy(self) for k in registry.KERNELS if k.reads is not None and k.reads not in unused}
        return _held_bytes(self.weights, self.bias, *copies.values())

    def release_unused(self) -> None:
        """Drop the kernel copies the chosen kernel does not read."""
        for name in self._unused_copies():
            self.drop_copy(name)

    def drop_copy(self, name: str) -> None:
        """Drop the weight copy held in attribute `name` (with the cuDNN search shape that goes with the dense one)."""
        setattr(self, name, None)
        if self.dense_weight is None:
            self.benchmarked_shape = None

    def _unused_copies(self) -> tuple[str, ...]:
        reads = registry.BY_NAME[self.conv_kernel].reads
        return tuple(name for name in registry.WEIGHT_COPIES if name != reads)

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
        """The layer's output on the batch `values[0]` (and its residual `values[1]`), by the kernel the backend
        and `conv_kernel` name (`registry.kernel_for`); on the CPU, by the call prepared for this state where it takes
        the input (`ops/conv/cpu/prepared.py`; the CPU kernel prepares it)."""
        if state.backend == "cpu":
            prepared = state.prepared.get(id(self))
            if prepared is not None and prepared.accepts(values[0]):
                return prepared(values[0], values[1] if self.residual else None, state)
        kernel = registry.kernel_for(state.backend, self.conv_kernel)
        unsupported = kernel.unsupported_dtype(self.weights.values.dtype)
        if unsupported is not None:
            raise ValueError(f"{self.name}: {unsupported}")
        return kernel.run(self, values[0], values[1] if self.residual else None, state)


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
        if state.backend == "cpu":
            prepared = state.prepared.get(id(self))
            if prepared is None or not prepared.accepts(x):
                self._check_input(x)
                if x.dtype != torch.float32:
                    raise ValueError(f"{self.name}: the cpu backend runs float32 networks only, got {x.dtype}")
                prepared = state.prepared[id(self)] = linear_cpu.PreparedLinear(self, state, x.shape[0])
            return prepared(x, state)
        self._check_input(x)
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
            y = linear_triton.linear(acts, self.weights, self.bias.to(torch.float32, copy=True))
            outputs.append((y.relu_() if self.relu else y).to(x.dtype))
        return batched(outputs)

    def _check_input(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.weights.in_features:
            raise ValueError(f"{self.name}: expected input [N, {self.weights.in_features}], got {tuple(x.shape)}")


@dataclass
class DenseStep:
    name: str
    inputs: list[str]
    output: str
    fn: Callable[..., torch.Tensor]

    def run(self, values: Sequence[torch.Tensor], state: RunState) -> torch.Tensor:
        return self.fn(*values)


Step = SparseConvStep | SparseLinearStep | DenseStep

