"""A converted sparse CNN: a straight-line plan of steps over named dense activations.

Between layers activations are dense `[N, C, H, W]` tensors (SCNN keeps accumulators dense until
ReLU); each sparse layer compresses its own input for its own geometry (padding and stride phases),
multiplies compressed weights by compressed activations, and accumulates into a dense output that
starts as bias (+ the residual, when a residual add was fused into it), then applies ReLU in place
when one was fused. Pooling, flatten and unfused ReLU/adds run as dense PyTorch ops: on dense
tensors they are single cheap passes, while a compressed version would need irregular gathers.

Backends: `"cuda"` (the default on a GPU: each convolution by the shared-memory CUDA C++ kernel,
with bias, residual and ReLU fused, by the Triton kernel, by the register-tiled sparse-weight
kernel (`ops/conv/register_cuda.py`, which reads the dense input, so that layer skips compression),
or by cuDNN fp32 on the dense pruned weights (alone, or fused with bias, residual and ReLU in one
call) or cuBLAS (the convolution as one matrix product, `ops/conv/gemm.py`), whichever `tune` measured
fastest for that layer; compression and FC layers by Triton kernels),
`"triton"` (every op a Triton kernel, convolutions accumulating by global atomics; also runs on
CPU tensors under `TRITON_INTERPRET=1`) and `"cpu"` (compiled numba loops, `ops/conv/cpu.py`: per layer SCNN's
Cartesian product or the output-stationary sparse-weight dataflow, whichever its cost model
predicts faster, on `threads` threads of numba's pool; the CPU steps read their dense input
directly, compress it only for SCNN's dataflow, and fuse bias, residual and ReLU into the kernels).
A plain forward launches the layers' kernels and nothing else: the kernels that read compressed
activations or count them on the way report each layer's input nonzeros, the others (dense fallbacks, the FC
row kernel) only in `tune`, `profile` or with `count_activations`. The GPU forwards never sync with
the host: every buffer has a static size, nonzero counts stay on the device, overflow of a reduced
activation capacity raises a device flag that `check_overflow()` turns into an error after the run.
So a whole network replays inside one CUDA graph.

A batch is run one sample at a time (the engine is built for batch-1 latency), except by cuDNN and cuBLAS,
which take it whole; a batch of one is a view of the sample's output, not a copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import warnings
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
from tendril.sparse.ops.conv import register_cuda, register_tiling
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
    where it measured faster than every sparse kernel; see `_run_dense`)."""
    dense_weight: torch.Tensor | None = None
    """The pruned weights as a dense tensor, kept only for the dense kernels."""
    benchmarked_shape: tuple[int, ...] | None = None
    """The input shape `tune` ran the dense kernels at with cuDNN's benchmark mode (the search runs eagerly there):
    inputs of this shape use the measured algorithm, others cuDNN's heuristic (no search inside a graph capture).
    On the H200 the search chose algorithms as fast as the heuristic's for AlexNet, VGG-16 and ResNet-50."""
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
            return self._run_dense(x, values[1] if self.residual else None, state)
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

    def _run_dense(self, x: torch.Tensor, residual: torch.Tensor | None, state: RunState) -> torch.Tensor:
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


@dataclass(frozen=True)
class LayerReport:
    name: str
    kind: str
    weight_density: float
    activation_density: float | None
    """Fraction of nonzero input activations at the last forward that counted them (None before any): every
    forward for layers whose kernels count on the way, else the last `tune`, `profile` or forward with
    `SparseNetwork.count_activations`."""
    weight_bytes: int
    """The weight bytes the layer holds (`held_bytes`): compressed weights, bias, and every GPU kernel's copy of
    the weights still held (tile order, register packing, dense, CSR; `SparseNetwork.release_unused_kernels` drops
    the ones its chosen kernel does not read)."""
    dense_weight_bytes: int


AGREEMENT_RTOL = 1e-5
"""Largest relative error (Frobenius norm) of the register-tiled kernel's layer output against the layer's
float64 dense reference (`SparseConvStep.reference`) for `tune` to admit it."""
REGISTER_PLANS_TIMED = 3
"""How many of the register planner's best-predicted plans `tune` times on each layer (it keeps the fastest):
the shortlist of distinct register tiles (`register_tiling.shortlist`), since the model's error (~8% on the
H200) exceeds its spread between the best few plans. For 1×1 layers it holds the best pixel-run plan and the
best 2-D tile plan at least (the model is calibrated on tiles only)."""


TUNE_SLEEP_CYCLES = 20_000_000
"""GPU sleep (about 10 ms on the H200) ahead of each candidate's timed calls in `tune`, longer than the host needs
to enqueue them: the time is the kernels' on the device, as inside a CUDA graph, not the host's launch cost
(which, timed eagerly, favoured kernels with fewer launches on small layers)."""


def _device_ms(run: Callable[[], object], reps: int) -> float:
    """Device milliseconds of `reps` calls of `run` (after one untimed call), queued behind a GPU sleep."""
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(TUNE_SLEEP_CYCLES)  # the calls queue up behind it: device time, as in a graph
    start.record()
    for _ in range(reps):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


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
        self.rejected_kernels: dict[str, dict[str, str]] = {}
        """`{layer: {kernel: why}}` for the candidates `tune` refused (`CHECKED_KERNELS` that failed to build or run,
        or disagreed with the layer's reference)."""
        self.pixel_runs = True
        """Whether `tune` also times the register-tiled kernel's pixel-run plans for 1×1 convolutions. On the
        H200 the best pixel-run plan beat the best tile plan on each of ResNet-50's 14 distinct 1×1 layers
        (0.61 ms against 0.93 ms in all, `sparse-conv-kernels`); `convert(..., pixel_runs=False)` leaves them out."""
        self.dense_fallback = True
        """Whether `tune` also times fp32 dense math (cuDNN, and cuBLAS as one matrix product) on each convolution's
        dense pruned weights and keeps it where it is faster than every sparse kernel
        (`convert(..., dense_fallback=False)`: sparse kernels only). The layers that fell back, with every
        candidate's time, are in `kernel_times` and the layer report."""
        self._released = False
        self.kernel_times: dict[str, dict[str, float]] = {}
        """`{layer: {kernel: ms}}` as `tune` measured them on the example input (`reps` calls each)."""
        self.count_activations = False
        """Whether every forward also counts the nonzero inputs of the layers whose kernels do not count them on
        the way (dense fallbacks, the FC row kernel), for `layers`: one reduction (three small kernels, ~11 us on
        the H200) per such layer. Off by default, so those densities are from the last `tune` or `profile`
        forward (which always count)."""

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
        self._state.count_inputs = self.count_activations
        values = {self.input_name: x}
        for step in self.steps:
            values[step.output] = step.run([values[name] for name in step.inputs], self._state)
        return values[self.output_name]

    __call__ = forward

    @torch.no_grad()
    def profile(self, x: torch.Tensor) -> list[tuple[str, float]]:
        """One forward timing each step (CUDA events on the GPU, wall clock on the CPU): `(step, ms)`. It counts
        every layer's nonzero inputs (for `layers`), and the time of layers that count with extra kernels
        includes theirs."""
        values = {self.input_name: x}
        self._state.count_inputs = True
        if self.device.type != "cuda":
            timings = []
            for step in self.steps:
                start = time.perf_counter()
                values[step.output] = step.run([values[name] for name in step.inputs], self._state)
                timings.append((step.name, (time.perf_counter() - start) * 1e3))
            return timings
        events = []
        for step in self.steps:
            begin_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin_event.record()
            values[step.output] = step.run([values[name] for name in step.inputs], self._state)
            end_event.record()
            events.append((step.name, begin_event, end_event))
        torch.cuda.synchronize(self.device)
        return [(name, b.elapsed_time(e)) for name, b, e in events]

    @torch.no_grad()
    def tune(self, x: torch.Tensor, reps: int = 10) -> dict[str, str]:
        """Pick each convolution's kernel by timing the candidates on `x`: shared-memory CUDA (`"cuda"`),
        Triton atomics (`"triton"`), where its planner supports the geometry, the register-tiled
        sparse-weight kernel (`"register"`, timed on the layer's dense input, as it runs) and, with
        `dense_fallback`, fp32 dense math on the dense pruned weights (`dense_kernels_for`: cuDNN's `"dense"`,
        `"dense-fused"` for layers with a ReLU, and cuBLAS's `"gemm"` for ungrouped ones); and each fully-connected
        layer's two kernels (`SparseLinearStep.fc_kernel`), the row kernel in each of `linear_triton.ROWS_CONFIGS`.

        Runs one forward, and for every convolution times the kernels on the activations it really
        sees, behind a GPU sleep so the device time counts, not the launches (a network runs in a CUDA
        graph), the sparse-activation kernels with their input's compression (host syncs: call it once,
        after conversion, never inside a graph capture). Returns
        `{layer: kernel}`; the choice is used by the `"cuda"` backend.

        The register-tiled kernel is timed with the planner's `REGISTER_PLANS_TIMED` best plans (the fastest
        stays). It and the dense kernels (cuDNN in benchmark mode: it times its algorithms on the layer's input shape)
        are candidates only once the layer output agrees with the layer's float64 dense reference
        (`SparseConvStep.reference`, relative error <= `AGREEMENT_RTOL`); one that fails to build or run, or
        disagrees, is left out, with the reason in `rejected_kernels` and a warning. (The reference is not
        another kernel: the shared-memory kernel is wrong by design when a reduced activation capacity
        overflows, and would make a correct register kernel look wrong.)
        """
        if self._released:
            raise ValueError("release_unused_kernels() freed the other kernels' weights: convert again to tune")
        if self.device.type != "cuda" or self.backend != "cuda":
            return {}
        self._precompile_register_kernels()
        values = {self.input_name: x}
        choice: dict[str, str] = {}
        for step in self.steps:
            inputs = [values[name] for name in step.inputs]
            self._state.count_inputs = False  # candidates are timed as a plain forward runs them
            if isinstance(step, SparseConvStep) and step.tiled is not None:
                times = self._time_conv_kernels(step, inputs, reps)
                for kernel in CHECKED_KERNELS:
                    rejection = self._rejection(step, inputs, kernel) if kernel in times else None
                    if rejection is not None:
                        del times[kernel]
                        self._reject(step.name, kernel, rejection)
                step.conv_kernel = choice[step.name] = min(times, key=lambda k: times[k])
                self.kernel_times[step.name] = times
                if step.conv_kernel not in DENSE_KERNELS:
                    step.dense_weight = step.benchmarked_shape = None
            elif isinstance(step, SparseLinearStep):
                times = self._time_linear_kernels(step, inputs[0][0].contiguous(), reps)
                step.fc_kernel = choice[step.name] = min(times, key=lambda k: times[k])
                self.kernel_times[step.name] = times
                if step.fc_kernel != "rows":
                    step.csr = None
            self._state.count_inputs = True  # the layer report's densities
            values[step.output] = step.run(inputs, self._state)
        return choice

    def register_plans(self) -> list[register_tiling.RegisterTilePlan]:
        """Every register-tiled plan `tune` would time on this network (GPU only), e.g. to compile several
        networks' kernels at once with `register_cuda.precompile` before tuning them."""
        if self.device.type != "cuda":
            return []
        return [
            plan
            for step in self.steps
            if isinstance(step, SparseConvStep) and step.tiled is not None and step.register is None
            for plan in self._register_plans(step)
        ]

    def _register_plans(self, step: SparseConvStep) -> list[register_tiling.RegisterTilePlan]:
        """The planner's shortlist of `REGISTER_PLANS_TIMED` plans for `step` (none where it cannot run it)."""
        g = step.weights.geometry
        if register_tiling.unsupported_reason(g) is not None:
            return []
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        plans = register_tiling.shortlist(g, step.weights.density, sms, REGISTER_PLANS_TIMED)
        return [p for p in plans if self.pixel_runs or not p.pixel_run]

    def _precompile_register_kernels(self) -> None:
        """Compile every layer's candidate register-tiled kernels at once, in parallel processes (one kernel
        per plan, ~1 s each); a failure only means that they compile one by one as they are first run."""
        try:
            register_cuda.precompile(self.register_plans())
        except Exception as error:  # e.g. no writable cache directory or a worker that cannot start
            warnings.warn(f"register-tiled kernels not precompiled ({error}); they compile one by one", stacklevel=3)

    def _rejection(self, step: SparseConvStep, inputs: list[torch.Tensor], kernel: str) -> str | None:
        """Why `kernel` must not serve `step` (None: its output agrees with the layer's float64 dense reference on
        this input)."""
        expected = step.reference(inputs)
        previous, step.conv_kernel = step.conv_kernel, kernel
        try:
            got = step.run(inputs, self._state)
        except Exception as error:  # a kernel that cannot run here is a rejected candidate, not a failed tune
            return f"{type(error).__name__}: {error}"
        finally:
            step.conv_kernel = previous
        error_norm = (got.double() - expected).norm() / expected.norm().clamp_min(torch.finfo(torch.float32).tiny)
        if not torch.isfinite(got).all() or error_norm > AGREEMENT_RTOL:
            return f"relative error {float(error_norm):.2e} against the dense reference (limit {AGREEMENT_RTOL})"
        return None

    def _reject(self, layer: str, kernel: str, why: str) -> None:
        self.rejected_kernels.setdefault(layer, {})[kernel] = why
        warnings.warn(f"{layer}: {kernel} kernel not used: {why}", stacklevel=3)

    def _time_conv_kernels(self, step: SparseConvStep, inputs: list[torch.Tensor], reps: int) -> dict[str, float]:
        """Milliseconds of `reps` calls of each candidate kernel on one layer's real input (and residual)."""
        g = step.weights.geometry
        dense_input = inputs[0][0].contiguous()
        residual = inputs[1][0].contiguous() if step.residual else None
        init = torch.zeros(g.out_channels, *g.out_hw, device=self.device)

        def compress_and_convolve() -> object:  # as the layer runs: its input is compressed first
            return step.convolve(self._state.compress(step.name, dense_input, step.layout), init, self._state)

        candidates: dict[str, Callable[[], object]] = {"cuda": compress_and_convolve, "triton": compress_and_convolve}
        layers = self._register_layers(step, dense_input)
        for rank, layer in enumerate(layers):
            candidates[f"register {rank}"] = functools.partial(
                register_cuda.conv, dense_input, layer, step.bias, residual=residual, relu=step.relu
            )
        if self.dense_fallback:
            step.dense_weight = step.weights.to_dense().to(self.device)
            step.benchmarked_shape = (1, *dense_input.shape)  # the first, untimed call of each runs cuDNN's search
            batch_residual = None if residual is None else residual[None]
            for kernel in dense_kernels_for(step):
                candidates[kernel] = functools.partial(step._run_dense, dense_input[None], batch_residual, self._state)
        times = {}
        for kernel, run_kernel in candidates.items():
            step.conv_kernel = kernel
            try:
                times[kernel] = _device_ms(run_kernel, reps)
            except Exception as error:
                if kernel not in CHECKED_KERNELS:
                    raise
                self._reject(step.name, kernel, f"{type(error).__name__}: {error}")  # e.g. a fusion cuDNN refuses
        step.conv_kernel = "cuda"
        if layers:
            fastest = min(range(len(layers)), key=lambda rank: times[f"register {rank}"])
            step.register = layers[fastest]
            times["register"] = times[f"register {fastest}"]
        return {k: t for k, t in times.items() if not k.startswith("register ")}

    def _time_linear_kernels(self, step: SparseLinearStep, dense_input: torch.Tensor, reps: int) -> dict[str, float]:
        """Milliseconds of `reps` calls of each fully-connected kernel on the layer's real input, as it runs."""
        step.csr = step.weights.to_csr()
        step.fc_kernel = "spmspv"
        times = {"spmspv": _device_ms(functools.partial(step.run, [dense_input[None]], self._state), reps)}
        step.fc_kernel = "rows"
        rows_times = {}
        for config in linear_triton.ROWS_CONFIGS:
            step.rows_config = config
            rows_times[config] = _device_ms(functools.partial(step.run, [dense_input[None]], self._state), reps)
        step.rows_config = min(rows_times, key=lambda c: rows_times[c])
        times["rows"] = rows_times[step.rows_config]
        return times

    def _register_layers(
        self, step: SparseConvStep, dense_input: torch.Tensor
    ) -> list[register_cuda.RegisterConvLayer]:
        """The register-tiled kernel's candidate layers for `step`, built and run once (compiled): the one
        prepared before, else the planner's `REGISTER_PLANS_TIMED` best plans; none where the planner does
        not support the geometry or the kernel was rejected (a failure to build or run is recorded here)."""
        rejected = "register" in self.rejected_kernels.get(step.name, {})
        if register_tiling.unsupported_reason(step.weights.geometry) is not None or rejected:
            return []
        try:
            if step.register is not None:
                layers = [step.register]
            else:
                layers = [register_cuda.RegisterConvLayer.prepare(step.weights, p) for p in self._register_plans(step)]
            for layer in layers:
                register_cuda.conv(dense_input, layer, step.bias, relu=step.relu)  # compiles it
        except Exception as error:  # e.g. an NVRTC that rejects the source: the other kernels still serve
            self._reject(step.name, "register", f"{type(error).__name__}: {error}")
            return []
        return layers

    def reset_overflow(self) -> None:
        self._state.overflow.zero_()

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
                    step.held_bytes(),
                    4 * dense_w + bias_bytes,
                )
            )
        return reports

    def release_unused_kernels(self) -> SparseNetwork:
        """Free every layer's kernel copies of its weights that its chosen kernel does not read (`tune` keeps the
        tile-ordered copy of the shared-memory kernel and the chosen register packing of every layer, so that it
        can tune again): the compressed weights stay, so the Triton and CPU paths and the references still work,
        but `tune` and forcing another GPU kernel on a layer then raise (convert again for that)."""
        for step in self.steps:
            if isinstance(step, (SparseConvStep, SparseLinearStep)):
                step.release_unused()
        self._released = True
        return self

    def weight_bytes(self, in_use_only: bool = False) -> tuple[int, int]:
        """Total weight bytes held (`LayerReport.weight_bytes`; `in_use_only`: what `release_unused_kernels` would
        leave) and the dense fp32 weights' bytes."""
        layers = self.layers()
        if in_use_only:
            held = sum(s.held_bytes(in_use_only=True) for s in self.steps if not isinstance(s, DenseStep))
        else:
            held = sum(r.weight_bytes for r in layers)
        return held, sum(r.dense_weight_bytes for r in layers)
