"""`SparseNetwork.tune`: time every layer's candidate kernels on its real input and keep the fastest that
agrees with the layer's float64 dense reference.

Candidates are timed behind a GPU sleep (`device_ms`), so the time is the kernels' on the device, as
inside the CUDA graph a network runs in, not the host's launch cost. The candidates are the
registered kernels' variants (`ops.conv.registry`, `ConvKernel.variants`; the register-tiled kernel's are the
planner's best plans, the fastest stays). The checked ones (the register-tiled and dense kernels) are
admitted only once the layer's output agrees with `SparseConvStep.reference` (`AGREEMENT_RTOL`): the
reference is not another kernel, since the shared-memory kernel is wrong by design when a reduced
activation capacity overflows, and would make a correct register kernel look wrong. A kernel that does not run the
network's dtype (`ConvKernel.dtypes`) is not a candidate: `tune` records why in `rejected_kernels`, once per layer,
and warns once per kernel.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tendril.sparse.ops.conv import registry
from tendril.sparse.ops.conv.interface import TuneSample
from tendril.sparse.ops.conv.register import dataflow as register_dataflow
from tendril.sparse.ops.conv.register.tiling import RegisterTilePlan
from tendril.sparse.ops.linear import triton as linear_triton
from tendril.sparse.steps import SparseConvStep, SparseLinearStep

if TYPE_CHECKING:
    from tendril.sparse.network import SparseNetwork

AGREEMENT_RTOL = 1e-5
"""Largest relative error (Frobenius norm) of a checked kernel's layer output against the layer's
float64 dense reference (`SparseConvStep.reference`) for `tune` to admit it, in an fp32 network."""
HALF_AGREEMENT_RTOL = {torch.float16: 5e-3, torch.bfloat16: 4e-2}
"""The same for half networks: a correct kernel's error is the rounding of its output to the dtype (unit roundoff
2^-11 for fp16, 2^-8 for bf16, a root-mean-square error of about a third of it), plus the order of fp32 sums; the
limits leave room for that and catch a wrong kernel, whose error is of order 1."""
TUNE_SLEEP_CYCLES = 20_000_000
"""GPU sleep ahead of each candidate's timed calls, longer than the host needs to enqueue them: the time is the
kernels' on the device, as inside a CUDA graph, not the host's launch cost (which, timed eagerly, favours
kernels with fewer launches on small layers)."""


def agreement_rtol(dtype: torch.dtype) -> float:
    """The admission limit of `tune` for a network of `dtype`."""
    return HALF_AGREEMENT_RTOL.get(dtype, AGREEMENT_RTOL)


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
        for kernel in registry.KERNELS:
            if kernel.unsupported_dtype(self.net.dtype) is None:
                kernel.before_tune(self)
            else:
                warnings.warn(f"{kernel.unsupported_dtype(self.net.dtype)}: tune skips it", stacklevel=3)
        values = {self.net.input_name: x}
        choice: dict[str, str] = {}
        for step in self.net.steps:
            inputs = [values[name] for name in step.inputs]
            self.net.state.count_inputs = False  # candidates are timed as a plain forward runs them
            if isinstance(step, SparseConvStep):
                times = self.time_conv_kernels(step, inputs, reps)
                for name in registry.CHECKED_KERNELS:
                    rejection = self.rejection(step, inputs, name) if name in times else None
                    if rejection is not None:
                        del times[name]
                        self.reject(step.name, name, rejection)
                step.conv_kernel = choice[step.name] = min(times, key=lambda k: times[k])
                self.net.kernel_times[step.name] = times
                chosen = registry.BY_NAME[step.conv_kernel].reads
                for kernel in registry.KERNELS:
                    if not kernel.kept_after_tune and kernel.reads is not None and kernel.reads != chosen:
                        step.drop_copy(kernel.reads)
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
        networks' kernels at once with `register.kernel.precompile` before tuning them."""
        return register_dataflow.network_plans(self.net)

    def plans_for(self, step: SparseConvStep) -> list[RegisterTilePlan]:
        """The register planner's shortlist of plans `tune` times on `step` (none where it cannot run it)."""
        return register_dataflow.plans_for(step, self.net)

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
        limit = agreement_rtol(self.net.dtype)
        if not torch.isfinite(got).all() or error_norm > limit:
            return f"relative error {float(error_norm):.2e} against the dense reference (limit {limit})"
        return None

    def reject(self, layer: str, kernel: str, why: str) -> None:
        self.net.rejected_kernels.setdefault(layer, {})[kernel] = why
        warnings.warn(f"{layer}: {kernel} kernel not used: {why}", stacklevel=3)

    def time_conv_kernels(self, step: SparseConvStep, inputs: list[torch.Tensor], reps: int) -> dict[str, float]:
        """Milliseconds of `reps` calls of each candidate kernel on one layer's real input (and residual): every
        registered kernel's variants, all prepared first, then timed in order; a kernel's time is its fastest
        variant's, whose weight copy the layer keeps. A checked kernel's variant that fails is rejected."""
        g = step.weights.geometry
        sample = TuneSample(
            inputs[0][0].contiguous(),
            inputs[1][0].contiguous() if step.residual else None,
            torch.zeros(g.out_channels, *g.out_hw, device=self.net.device),
            self.net.state,
        )
        candidates = []
        for kernel in registry.KERNELS:
            unsupported = kernel.unsupported_dtype(self.net.dtype)
            if unsupported is None:
                candidates.append((kernel, kernel.variants(step, sample, self)))
            else:
                self.net.rejected_kernels.setdefault(step.name, {})[kernel.name] = unsupported
        times = {}
        for kernel, variants in candidates:
            timed = {}
            for rank, variant in enumerate(variants):
                try:
                    timed[rank] = device_ms(variant.run, reps)
                except Exception as error:
                    if not kernel.checked:
                        raise
                    label = kernel.name if len(variants) == 1 else f"{kernel.name} {rank}"
                    self.reject(step.name, label, f"{type(error).__name__}: {error}")  # e.g. a fusion cuDNN refuses
            if timed:
                fastest = min(timed, key=lambda rank: timed[rank])
                times[kernel.name] = timed[fastest]
                if kernel.reads is not None:
                    setattr(step, kernel.reads, variants[fastest].copy)
        return times

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
