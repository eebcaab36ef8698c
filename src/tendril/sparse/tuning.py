"""`SparseNetwork.tune`: time every layer's candidate kernels on its real input and keep the fastest that
agrees with the layer's float64 dense reference.

Candidates are timed behind a GPU sleep (`device_ms`), so the time is the kernels' on the device, as
inside the CUDA graph a network runs in, not the host's launch cost. The register-tiled kernel is timed
with the planner's `REGISTER_PLANS_TIMED` best plans (the fastest stays). It and the dense kernels are
admitted only once the layer's output agrees with `SparseConvStep.reference` (`AGREEMENT_RTOL`): the
reference is not another kernel, since the shared-memory kernel is wrong by design when a reduced
activation capacity overflows, and would make a correct register kernel look wrong.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tendril.sparse.ops.conv import register_cuda, register_planner
from tendril.sparse.ops.conv.register_tiling import RegisterTilePlan
from tendril.sparse.ops.linear import triton as linear_triton
from tendril.sparse.steps import CHECKED_KERNELS, DENSE_KERNELS, SparseConvStep, SparseLinearStep, dense_kernels_for

if TYPE_CHECKING:
    from tendril.sparse.network import SparseNetwork

AGREEMENT_RTOL = 1e-5
"""Largest relative error (Frobenius norm) of a checked kernel's layer output against the layer's
float64 dense reference (`SparseConvStep.reference`) for `tune` to admit it."""
REGISTER_PLANS_TIMED = 3
"""How many of the register planner's best-predicted plans `tune` times on each layer (it keeps the fastest):
the shortlist of distinct register tiles (`register_planner.shortlist`), since the cost model's error exceeds
its spread between the best few plans. For 1×1 layers it holds the best pixel-run plan and the best 2-D tile
plan at least (the model is calibrated on tiles only)."""
TUNE_SLEEP_CYCLES = 20_000_000
"""GPU sleep ahead of each candidate's timed calls, longer than the host needs to enqueue them: the time is the
kernels' on the device, as inside a CUDA graph, not the host's launch cost (which, timed eagerly, favours
kernels with fewer launches on small layers)."""


def device_ms(run: Callable[[], object], reps: int) -> float:
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


class KernelTuner:
    """Tunes one network's kernels in place; its choices and rejections land in the network's `kernel_times`
    and `rejected_kernels`."""

    def __init__(self, net: SparseNetwork) -> None:
        self.net = net

    def tune(self, x: torch.Tensor, reps: int) -> dict[str, str]:
        """Run one forward on `x`, choosing each layer's kernel on the input it sees (`SparseNetwork.tune`)."""
        if self.net.device.type != "cuda" or self.net.backend != "cuda":
            return {}
        self.precompile_register_kernels()
        values = {self.net.input_name: x}
        choice: dict[str, str] = {}
        for step in self.net.steps:
            inputs = [values[name] for name in step.inputs]
            self.net.state.count_inputs = False  # candidates are timed as a plain forward runs them
            if isinstance(step, SparseConvStep) and step.tiled is not None:
                times = self.time_conv_kernels(step, inputs, reps)
                for kernel in CHECKED_KERNELS:
                    rejection = self.rejection(step, inputs, kernel) if kernel in times else None
                    if rejection is not None:
                        del times[kernel]
                        self.reject(step.name, kernel, rejection)
                step.conv_kernel = choice[step.name] = min(times, key=lambda k: times[k])
                self.net.kernel_times[step.name] = times
                if step.conv_kernel not in DENSE_KERNELS:
                    step.dense_weight = step.benchmarked_shape = None
            elif isinstance(step, SparseLinearStep):
                times = self.time_linear_kernels(step, inputs[0][0].contiguous(), reps)
                step.fc_kernel = choice[step.name] = min(times, key=lambda k: times[k])
                self.net.kernel_times[step.name] = times
                if step.fc_kernel != "rows":
                    step.csr = None
            self.net.state.count_inputs = True  # the layer report's densities
            values[step.output] = step.run(inputs, self.net.state)
        return choice

    def register_plans(self) -> list[RegisterTilePlan]:
        """Every register-tiled plan `tune` would time on this network (GPU only), e.g. to compile several
        networks' kernels at once with `register_cuda.precompile` before tuning them."""
        if self.net.device.type != "cuda":
            return []
        return [
            plan
            for step in self.net.steps
            if isinstance(step, SparseConvStep) and step.tiled is not None and step.register is None
            for plan in self.plans_for(step)
        ]

    def plans_for(self, step: SparseConvStep) -> list[RegisterTilePlan]:
        """The planner's shortlist of `REGISTER_PLANS_TIMED` plans for `step` (none where it cannot run it)."""
        g = step.weights.geometry
        if register_planner.unsupported_reason(g) is not None:
            return []
        sms = torch.cuda.get_device_properties(self.net.device).multi_processor_count
        plans = register_planner.shortlist(g, step.weights.density, sms, REGISTER_PLANS_TIMED)
        return [p for p in plans if self.net.pixel_runs or not p.pixel_run]

    def precompile_register_kernels(self) -> None:
        """Compile every layer's candidate register-tiled kernels at once, in parallel processes (one kernel
        per plan); a failure only means that they compile one by one as they are first run."""
        try:
            register_cuda.precompile(self.register_plans())
        except Exception as error:  # e.g. no writable cache directory or a worker that cannot start
            warnings.warn(f"register-tiled kernels not precompiled ({error}); they compile one by one", stacklevel=3)

    def rejection(self, step: SparseConvStep, inputs: list[torch.Tensor], kernel: str) -> str | None:
        """Why `kernel` must not serve `step` (None: its output agrees with the layer's float64 dense reference on
        this input)."""
        expected = step.reference(inputs)
        previous, step.conv_kernel = step.conv_kernel, kernel
        try:
            got = step.run(inputs, self.net.state)
        except Exception as error:  # a kernel that cannot run here is a rejected candidate, not a failed tune
            return f"{type(error).__name__}: {error}"
        finally:
            step.conv_kernel = previous
        error_norm = (got.double() - expected).norm() / expected.norm().clamp_min(torch.finfo(torch.float32).tiny)
        if not torch.isfinite(got).all() or error_norm > AGREEMENT_RTOL:
            return f"relative error {float(error_norm):.2e} against the dense reference (limit {AGREEMENT_RTOL})"
        return None

    def reject(self, layer: str, kernel: str, why: str) -> None:
        self.net.rejected_kernels.setdefault(layer, {})[kernel] = why
        warnings.warn(f"{layer}: {kernel} kernel not used: {why}", stacklevel=3)

    def time_conv_kernels(self, step: SparseConvStep, inputs: list[torch.Tensor], reps: int) -> dict[str, float]:
        """Milliseconds of `reps` calls of each candidate kernel on one layer's real input (and residual)."""
        g = step.weights.geometry
        dense_input = inputs[0][0].contiguous()
        residual = inputs[1][0].contiguous() if step.residual else None
        init = torch.zeros(g.out_channels, *g.out_hw, device=self.net.device)

        def compress_and_convolve() -> object:  # as the layer runs: its input is compressed first
            return step.convolve(self.net.state.compress(step.name, dense_input, step.layout), init, self.net.state)

        candidates: dict[str, Callable[[], object]] = {"cuda": compress_and_convolve, "triton": compress_and_convolve}
        layers = self.register_layers(step, dense_input)
        for rank, layer in enumerate(layers):
            candidates[f"register {rank}"] = functools.partial(
                register_cuda.conv, dense_input, layer, step.bias, residual=residual, relu=step.relu
            )
        if self.net.dense_fallback:
            step.dense_weight = step.weights.to_dense().to(self.net.device)
            step.benchmarked_shape = (1, *dense_input.shape)  # the first, untimed call of each runs cuDNN's search
            batch_residual = None if residual is None else residual[None]
            run_dense = functools.partial(step.run_dense, dense_input[None], batch_residual, self.net.state)
            for kernel in dense_kernels_for(step):
                candidates[kernel] = run_dense
        times = {}
        for kernel, run_kernel in candidates.items():
            step.conv_kernel = kernel
            try:
                times[kernel] = device_ms(run_kernel, reps)
            except Exception as error:
                if kernel not in CHECKED_KERNELS:
                    raise
                self.reject(step.name, kernel, f"{type(error).__name__}: {error}")  # e.g. a fusion cuDNN refuses
        step.conv_kernel = "cuda"
        if layers:
            fastest = min(range(len(layers)), key=lambda rank: times[f"register {rank}"])
            step.register = layers[fastest]
            times["register"] = times[f"register {fastest}"]
        return {k: t for k, t in times.items() if not k.startswith("register ")}

    def time_linear_kernels(self, step: SparseLinearStep, dense_input: torch.Tensor, reps: int) -> dict[str, float]:
        """Milliseconds of `reps` calls of each fully-connected kernel on the layer's real input, as it runs."""
        step.csr = step.weights.to_csr()
        step.fc_kernel = "spmspv"
        times = {"spmspv": device_ms(functools.partial(step.run, [dense_input[None]], self.net.state), reps)}
        step.fc_kernel = "rows"
        rows_times = {}
        for config in linear_triton.ROWS_CONFIGS:
            step.rows_config = config
            rows_times[config] = device_ms(functools.partial(step.run, [dense_input[None]], self.net.state), reps)
        step.rows_config = min(rows_times, key=lambda c: rows_times[c])
        times["rows"] = rows_times[step.rows_config]
        return times

    def register_layers(
        self, step: SparseConvStep, dense_input: torch.Tensor
    ) -> list[register_cuda.RegisterConvLayer]:
        """The register-tiled kernel's candidate layers for `step`, built and run once (compiled): the one
        prepared before, else the planner's `REGISTER_PLANS_TIMED` best plans; none where the planner does
        not support the geometry or the kernel was rejected (a failure to build or run is recorded here)."""
        rejected = "register" in self.net.rejected_kernels.get(step.name, {})
        if register_planner.unsupported_reason(step.weights.geometry) is not None or rejected:
            return []
        try:
            if step.register is not None:
                layers = [step.register]
            else:
                layers = [register_cuda.RegisterConvLayer.prepare(step.weights, p) for p in self.plans_for(step)]
            for layer in layers:
                register_cuda.conv(dense_input, layer, step.bias, relu=step.relu)  # compiles it
        except Exception as error:  # e.g. an NVRTC that rejects the source: the other kernels still serve
            self.reject(step.name, "register", f"{type(error).__name__}: {error}")
            return []
        return layers
