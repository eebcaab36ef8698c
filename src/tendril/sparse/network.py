"""A converted sparse CNN: a straight-line plan of steps (`tendril.sparse.steps`) over named dense activations.

Backends: `"cuda"` (the default on a GPU: each convolution by the shared-memory CUDA C++ kernel,
with bias, residual and ReLU fused, by the Triton kernel, by the register-tiled sparse-weight
kernel (`ops/conv/register/`, which reads the dense input, so that layer skips compression),
or by cuDNN in the network's dtype on the dense pruned weights (alone, or fused with bias, residual and ReLU in one
call) or cuBLAS (the convolution as one matrix product, `ops/conv/gemm/`), whichever `tune` measured
fastest for that layer (`tendril.sparse.tuning`); compression and FC layers by Triton kernels),
`"triton"` (every op a Triton kernel, convolutions accumulating by global atomics; also runs on
CPU tensors under `TRITON_INTERPRET=1`) and `"cpu"` (compiled numba loops, `ops/conv/cpu/`: per layer SCNN's
Cartesian product or the output-stationary sparse-weight dataflow, whichever its cost model
predicts faster, on `threads` threads of numba's pool, and on one thread the unpadded 1×1 layers by the library's
sparse product where `tune` found the forward faster that way, `cpu_library`; the CPU steps read their dense input
directly, compress it only for SCNN's dataflow, and fuse bias, residual and ReLU into the kernels).

A plain forward launches the layers' kernels and nothing else: the kernels that read compressed
activations or count them on the way report each layer's input nonzeros, the others (dense fallbacks, the FC
row kernel) only in `tune`, `profile` or with `count_activations`. The GPU forwards never sync with
the host: every buffer has a static size, nonzero counts stay on the device, overflow of a reduced
activation capacity raises a device flag that `check_overflow()` turns into an error after the run.
So a whole network replays inside one CUDA graph.

A network has one dtype (`dtype`: fp32, fp16 or bf16, the converted model's), its inputs, weights, activations and
output alike; kernels accumulate in fp32. The `"cpu"` backend runs fp32 only: `set_backend("cpu")` on a half
network raises (convert an fp32 copy of the model for the CPU), and a half network converted on the CPU starts on
the `"triton"` backend (which needs `TRITON_INTERPRET=1` there). On a GPU, `tune` skips the kernels that do not
run the network's dtype (`ConvKernel.dtypes`; the CUDA C++ ones are fp32 only), with the reason in
`rejected_kernels`.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from tendril.sparse.ops import cpu_threads
from tendril.sparse.ops.conv.cpu import kernel as cpu_kernel
from tendril.sparse.ops.conv.register.tiling import RegisterTilePlan
from tendril.sparse.steps import DenseStep, RunState, SparseConvStep, SparseLinearStep, Step
from tendril.sparse.tuning import KernelTuner
from tendril.sparse.validation import VALUE_DTYPES
from tendril.utils.checks import is_integer

BACKENDS = ("cuda", "triton", "cpu")

Method = TypeVar("Method", bound=Callable[..., Any])


def _one_call_at_a_time(method: Method) -> Method:
    """`method` run holding the network's lock (`SparseNetwork._turn`)."""

    @functools.wraps(method)
    def taking_turns(self: SparseNetwork, *args: Any, **kwargs: Any) -> Any:
        with self._turn:
            return method(self, *args, **kwargs)

    return cast(Method, taking_turns)


class ActivationOverflowError(RuntimeError):
    pass


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



@dataclass(frozen=True)
class StepCall:
    """One step of a forward, ready to run again on the activations it saw (`SparseNetwork.step_calls`)."""

    name: str
    kernel: str
    """The kernel the step runs: on the `"cuda"` backend a convolution's `conv_kernel` and a linear layer's
    `fc_kernel`, on the others the backend's name; `"dense op"` for the steps between layers."""
    run: Callable[[], torch.Tensor]


class SparseNetwork:
    """Runs a plan built by `tendril.sparse.convert`; call it like the model it came from."""

    def __init__(
        self,
        steps: list[Step],
        input_name: str,
        output_name: str,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.steps = steps
        self.input_name = input_name
        self.output_name = output_name
        if dtype not in VALUE_DTYPES:
            raise ValueError(f"dtype {dtype}: expected one of {VALUE_DTYPES}")
        self.device = device
        self.dtype = dtype
        """The dtype of inputs, weights, activations and outputs (fp32, fp16 or bf16)."""
        self.backend = "cuda" if device.type == "cuda" else ("cpu" if dtype == torch.float32 else "triton")
        self.threads = 1
        self._cpu_library = True
        self.cpu_library_ms: dict[str, float] = {}
        """`{"library": ms, "compiled": ms}`: the median forward times on which `tune` chose `cpu_library` (empty
        until it has)."""
        self._turn = threading.RLock()
        """Held by every call that runs steps or replaces the run state: calls from several threads take turns (the
        steps share the state's buffers, and the CPU backend's reused outputs)."""
        self._reused_outputs = _outputs_never_returned(steps, output_name)
        self._counted_outputs = _outputs_read_directly(steps, self._reused_outputs)
        self._planes_readers = _planes_readers(steps, self._reused_outputs)
        self.state = self._new_state(torch.zeros(1, dtype=torch.int32, device=device))
        """What every forward's steps share: backend, threads, the device overflow flag, the last nonzero counts, and
        the CPU backend's prepared calls (a new state for each `set_backend`)."""
        self.rejected_kernels: dict[str, dict[str, str]] = {}
        """`{layer: {kernel: why}}` for the candidates `tune` refused (`registry.CHECKED_KERNELS` that failed to build
        or run, or disagreed with the layer's reference)."""
        self.pixel_runs = True
        """Whether `tune` also times the register-tiled kernel's pixel-run plans for 1×1 convolutions (see the
        `sparse-conv-kernels` benchmark for how they compare with tile plans); `convert(..., pixel_runs=False)`
        leaves them out."""
        self.dense_fallback = True
        """Whether `tune` also times dense math in the network's dtype (cuDNN, and cuBLAS as one matrix product) on
        each convolution's dense pruned weights and keeps it where it is faster than every sparse kernel
        (`convert(..., dense_fallback=False)`: sparse kernels only). The layers that fell back, with every
        candidate's time, are in `kernel_times` and the layer report."""
        self._released = False
        self.kernel_times: dict[str, dict[str, float]] = {}
        """`{layer: {kernel: ms}}` as `tune` measured them on the example input (`reps` calls each)."""
        self.count_activations = False
        """Whether every forward also counts the nonzero inputs of the layers whose kernels do not count them on
        the way (dense fallbacks, the FC row kernel), for `layers`: one reduction (three small kernels) per such
        layer. Off by default, so those densities are from the last `tune` or `profile`
        forward (which always count)."""

    @_one_call_at_a_time
    def set_backend(self, backend: str, threads: int = 1) -> SparseNetwork:
        """Choose `"cuda"`, `"triton"` or `"cpu"` (with `threads` workers for the CPU backend)."""
        if backend not in BACKENDS:
            raise ValueError(f"backend {backend!r}: expected one of {BACKENDS}")
        if backend == "cpu" and self.device.type != "cpu":
            raise ValueError("the cpu backend needs a network converted on the CPU (convert a CPU copy of the model)")
        if backend == "cpu" and self.dtype != torch.float32:
            raise ValueError(
                f"backend 'cpu': runs float32 networks only, this one is {self.dtype}; convert a float32 copy of the "
                "model (model.float()) for the CPU"
            )
        if backend == "cuda" and self.device.type != "cuda":
            raise ValueError("the cuda backend needs a network converted on a GPU")
        if not is_integer(threads) or threads < 1:
            raise ValueError(f"threads={threads!r}: expected an integer, at least 1")
        self.backend, self.threads = backend, threads
        self.state = self._new_state(self.state.overflow)
        return self

    @property
    def cpu_library(self) -> bool:
        """Whether the CPU backend on one thread runs the unpadded 1×1 convolutions as the library's sparse product
        (torch's CSR `addmm`, MKL's sparse BLAS on x86) rather than the compiled loops. Which is faster depends on the
        host's library and cores, so `tune` times whole forwards both ways and keeps the faster (the compiled loops'
        outputs also land in the next layer's planes, which a layer-by-layer comparison would not count). True until
        then; setting it starts a new run state."""
        return self._cpu_library

    @cpu_library.setter
    def cpu_library(self, library: bool) -> None:
        with self._turn:
            self._cpu_library = bool(library)
            self.state = self._new_state(self.state.overflow)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (`copy.deepcopy`) without the lock, which `__setstate__` makes anew."""
        state = self.__dict__.copy()
        del state["_turn"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._turn = threading.RLock()

    def _new_state(self, overflow: torch.Tensor, library: bool | None = None) -> RunState:
        return RunState(
            self.backend,
            self.threads,
            overflow,
            library=self._cpu_library if library is None else library,
            reused_outputs=self._reused_outputs,
            counted_outputs=self._counted_outputs,
            planes_readers=self._planes_readers,
        )

    @_one_call_at_a_time
    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The model's output for `x`, a new tensor. On the CPU backend the layers whose outputs stay inside the
        network write them into buffers of their own, rewritten by every forward (`RunState.reused_outputs`), so calls
        from several threads take turns (`_turn`)."""
        if x.device != self.device or x.dtype != self.dtype:
            raise ValueError(f"x: expected a {self.dtype} input on {self.device}, got {x.dtype} on {x.device}")
        self.state.count_inputs = self.count_activations
        values = {self.input_name: x}
        with self._cpu_threads():
            for step in self.steps:
                values[step.output] = step.run([values[name] for name in step.inputs], self.state)
        return values[self.output_name]

    __call__ = forward

    def _cpu_threads(self) -> contextlib.AbstractContextManager[object]:
        """The CPU backend's thread counts for a whole forward (`cpu_threads.kernel_threads`: numba's workers for
        the kernels, torch on one thread so that its pool does not spin against them); nothing elsewhere."""
        if self.backend != "cpu":
            return contextlib.nullcontext()
        return cpu_threads.kernel_threads(self.threads)

    @_one_call_at_a_time
    @torch.no_grad()
    def profile(self, x: torch.Tensor, count_inputs: bool = True) -> list[tuple[str, float]]:
        """One forward timing each step (CUDA events on the GPU, wall clock on the CPU): `(step, ms)`. With
        `count_inputs` it counts every layer's nonzero inputs (for `layers`), and the time of layers that count with
        extra kernels includes theirs; without, the steps run as in `forward`."""
        values = {self.input_name: x}
        self.state.count_inputs = count_inputs or self.count_activations
        if self.device.type != "cuda":
            timings = []
            with self._cpu_threads():
                for step in self.steps:
                    start = time.perf_counter()
                    values[step.output] = step.run([values[name] for name in step.inputs], self.state)
                    timings.append((step.name, (time.perf_counter() - start) * 1e3))
            return timings
        events = []
        for step in self.steps:
            begin_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin_event.record()
            values[step.output] = step.run([values[name] for name in step.inputs], self.state)
            end_event.record()
            events.append((step.name, begin_event, end_event))
        torch.cuda.synchronize(self.device)
        return [(name, b.elapsed_time(e)) for name, b, e in events]

    @_one_call_at_a_time
    @torch.no_grad()
    def tune(self, x: torch.Tensor, reps: int = 10) -> dict[str, str]:
        """Pick each convolution's kernel by timing the candidates on `x`: shared-memory CUDA (`"cuda"`),
        Triton atomics (`"triton"`), where its planner supports the geometry, the register-tiled
        sparse-weight kernel (`"register"`, timed on the layer's dense input, as it runs) and, with
        `dense_fallback`, dense math in the network's dtype on the dense pruned weights
        (`ops.conv.registry.dense_kernels_for`: cuDNN's `"dense"`, `"dense-fused"` for layers with a ReLU, and
        cuBLAS's `"gemm"` for ungrouped ones), each where it runs the network's dtype (`ConvKernel.dtypes`): the
        registered kernels (`ops.conv.registry.KERNELS`); and each fully-connected layer's two kernels
        (`SparseLinearStep.fc_kernel`), the row kernel in each of `linear_triton.ROWS_CONFIGS`.

        Runs one forward, and for every convolution times the kernels on the activations it really
        sees, behind a GPU sleep so the device time counts, not the launches (a network runs in a CUDA
        graph), the sparse-activation kernels with their input's compression (host syncs: call it once,
        after conversion, never inside a graph capture). Returns
        `{layer: kernel}`; the choice is used by the `"cuda"` backend.

        The register-tiled kernel is timed with the planner's `register.dataflow.REGISTER_PLANS_TIMED` best plans
        (the fastest stays). It and the dense kernels (cuDNN in benchmark mode: it times its algorithms on the layer's
        input shape) are candidates only once the layer output agrees with the layer's float64 dense reference
        (`SparseConvStep.reference`, relative error <= `tuning.AGREEMENT_RTOL`); one that fails to build or run, or
        disagrees, is left out, with the reason in `rejected_kernels` and a warning (`tendril.sparse.tuning`).

        On the CPU backend on one thread it chooses `cpu_library` instead, by `reps` forwards each way, interleaved
        (`cpu_library_ms`), and returns `{layer: "spmm" or "compiled"}` for the layers it concerns; on several
        threads, where the compiled loops run every layer, it has nothing to choose.
        """
        if self._released:
            raise ValueError("release_unused_kernels() freed the other kernels' weights: convert again to tune")
        if not is_integer(reps) or reps < 1:
            raise ValueError(f"reps={reps!r}: expected an integer, at least 1 (timed calls of each candidate)")
        if self.backend == "cpu":
            return self._tune_cpu_library(x, reps)
        return KernelTuner(self).tune(x, reps)

    def _tune_cpu_library(self, x: torch.Tensor, reps: int) -> dict[str, str]:
        """`tune` on the CPU backend: on one thread, `cpu_library` set to whichever way gives the faster forward on
        `x`, by the median of `reps` forwards each way, interleaved, each way in a run state of its own that an untimed
        forward prepares first; the faster way's state is kept."""
        layers = [
            step.name
            for step in self.steps
            if isinstance(step, SparseConvStep) and cpu_kernel.has_library_product(step.weights.geometry)
        ]
        if self.threads != 1 or not layers:
            return {}
        states = {library: self._new_state(self.state.overflow, library) for library in (True, False)}
        samples: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(reps + 1):
            for library, state in states.items():
                self.state = state
                start = time.perf_counter()
                self(x)
                if rep:  # the first forward of each way prepares its calls
                    samples[library].append(time.perf_counter() - start)
        median = {library: statistics.median(times) * 1e3 for library, times in samples.items()}
        self.cpu_library_ms = {"library": median[True], "compiled": median[False]}
        self._cpu_library = median[True] <= median[False]
        self.state = states[self._cpu_library]
        return dict.fromkeys(layers, "spmm" if self._cpu_library else "compiled")

    def register_plans(self) -> list[RegisterTilePlan]:
        """Every register-tiled plan `tune` would time on this network (GPU only), e.g. to compile several
        networks' kernels at once with `register.kernel.precompile` before tuning them."""
        return KernelTuner(self).register_plans()

    @_one_call_at_a_time
    @torch.no_grad()
    def step_calls(self, x: torch.Tensor) -> list[StepCall]:
        """Run one forward on `x` and return every step ready to run again on the activations it saw there, with
        the kernel it runs (for timing and profiling step by step; each call recomputes the step's output)."""
        values = {self.input_name: x}
        calls = []
        for step in self.steps:
            args = [values[name] for name in step.inputs]

            def run(step: Step = step, args: list[torch.Tensor] = args) -> torch.Tensor:
                return step.run(args, self.state)

            values[step.output] = run()
            calls.append(StepCall(step.name, _kernel_of(step, self.backend), run))
        return calls

    def reset_overflow(self) -> None:
        self.state.overflow.zero_()

    def check_overflow(self) -> None:
        """Raise if any activation overflowed its capacity since the last check (host sync), then reset."""
        if bool(self.state.overflow.item()):
            self.state.overflow.zero_()
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
            counts = self.state.last_counts.get(step.name)
            dense_numel = step.layout.channels * step.layout.in_hw[0] * step.layout.in_hw[1]
            act = None if counts is None else float(counts.sum()) / dense_numel
            if isinstance(step, SparseConvStep):
                dense_w = step.weights.dense_numel
            else:
                dense_w = step.weights.in_features * step.weights.out_features
            bias_bytes = step.bias.nbytes
            reports.append(
                LayerReport(
                    step.name,
                    "conv" if isinstance(step, SparseConvStep) else "linear",
                    step.weights.density,
                    act,
                    step.held_bytes(),
                    step.bias.element_size() * dense_w + bias_bytes,
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
        leave) and the dense weights' bytes (in the network's dtype)."""
        layers = self.layers()
        if in_use_only:
            held = sum(s.held_bytes(in_use_only=True) for s in self.steps if not isinstance(s, DenseStep))
        else:
            held = sum(r.weight_bytes for r in layers)
        return held, sum(r.dense_weight_bytes for r in layers)


def _outputs_never_returned(steps: list[Step], output_name: str) -> frozenset[str]:
    """The sparse steps (by name) whose output the network never returns, whole or viewed: neither its output nor
    an input of a dense step whose output that is (a dense op may return a view of its input). A name that also
    names a step whose output is returned is left out."""
    producers: dict[str, list[Step]] = {}
    for step in steps:
        producers.setdefault(step.output, []).append(step)
    returned, pending = set(), [output_name]
    while pending:
        name = pending.pop()
        if name not in returned:
            returned.add(name)
            pending += [i for step in producers.get(name, []) if isinstance(step, DenseStep) for i in step.inputs]
    sparse = [step for step in steps if not isinstance(step, DenseStep)]
    inside = {step.name for step in sparse if step.output not in returned}
    return frozenset(inside - {step.name for step in sparse if step.output in returned})


def _outputs_read_directly(steps: list[Step], reused: frozenset[str]) -> frozenset[str]:
    """The convolutions (by name) in `reused` whose output a convolution that reads its input directly
    (`cpu_kernel.reads_input`) takes as its input: those whose CPU calls keep their output's nonzeros for it
    (`RunState.counted_outputs`)."""
    convolutions = [step for step in steps if isinstance(step, SparseConvStep)]
    read = {step.inputs[0] for step in convolutions if cpu_kernel.reads_input(step.weights.geometry)}
    return frozenset(step.name for step in convolutions if step.name in reused and step.output in read)


def _planes_readers(steps: list[Step], reused: frozenset[str]) -> dict[str, SparseConvStep]:
    """The convolutions in `reused` whose output only one step reads, a convolution whose phase planes hold its input
    as is (`cpu_kernel.holds_input`), mapped to that reader (`RunState.planes_readers`)."""
    readers: dict[str, list[Step]] = {}
    writers: dict[str, int] = {}
    for step in steps:
        writers[step.output] = writers.get(step.output, 0) + 1
        for name in step.inputs:
            readers.setdefault(name, []).append(step)
    found = {}
    for step in steps:
        read = readers.get(step.output, [])
        if not isinstance(step, SparseConvStep) or step.name not in reused or writers[step.output] != 1:
            continue
        reader = read[0] if len(read) == 1 else None
        if (
            isinstance(reader, SparseConvStep)
            and reader.inputs[0] == step.output
            and cpu_kernel.holds_input(reader.weights.geometry)
        ):
            found[step.name] = reader
    return found


def _kernel_of(step: Step, backend: str) -> str:
    """The kernel `step` runs under `backend`: the `"cpu"` and `"triton"` backends run their own for every layer."""
    if isinstance(step, SparseConvStep):
        return step.conv_kernel if backend == "cuda" else backend
    if isinstance(step, SparseLinearStep):
        return step.fc_kernel if backend == "cuda" else backend
    return "dense op"
