"""The register-tiled kernel as a `ConvKernel` (`"register"`): reads the layer's dense input (no compression,
so no capacity to overflow) and its `RegisterConvLayer` (the layer's `register`: packed weights for one plan
and the launch buffers), fuses bias, residual and ReLU, and reports the input's nonzero count from the
kernel's tile counts.

`tune` times the planner's `REGISTER_PLANS_TIMED` best plans (the fastest stays), compiling every layer's
candidate plans at once beforehand (`kernel.precompile`); it admits the kernel only once its output agrees with
the layer's reference.
"""

from __future__ import annotations

import functools
import warnings
from typing import TYPE_CHECKING

import torch

from tendril.sparse.ops.conv.interface import ConvKernel, TuneSample, Variant, batched
from tendril.sparse.ops.conv.register import kernel, planner
from tendril.sparse.ops.conv.register.tiling import RegisterTilePlan

if TYPE_CHECKING:
    from tendril.sparse.network import SparseNetwork
    from tendril.sparse.steps import RunState, SparseConvStep
    from tendril.sparse.tuning import KernelTuner

REGISTER_PLANS_TIMED = 3
"""How many of the register planner's best-predicted plans `tune` times on each layer (it keeps the fastest):
the shortlist of distinct register tiles (`planner.shortlist`), since the cost model's error exceeds
its spread between the best few plans. For 1×1 layers it holds the best pixel-run plan and the best 2-D tile
plan at least (the model is calibrated on tiles only)."""


class RegisterKernel(ConvKernel):
    name = "register"
    reads = "register"
    checked = True

    def run(
        self, step: SparseConvStep, x: torch.Tensor, residual: torch.Tensor | None, state: RunState
    ) -> torch.Tensor:
        if step.register is None:
            raise ValueError(
                f"{step.name}: the register kernel was chosen but not prepared; SparseNetwork.tune builds it"
            )
        outputs = []
        for b in range(x.shape[0]):
            resid = None if residual is None else residual[b].contiguous()
            y = kernel.conv(x[b].contiguous(), step.register, step.bias, residual=resid, relu=step.relu)
            outputs.append(y)
            state.last_counts[step.name] = step.register.counts
        return batched(outputs)

    def held_copy(self, step: SparseConvStep) -> object | None:
        return None if step.register is None else step.register.weights

    def before_tune(self, tuner: KernelTuner) -> None:
        """Compile every layer's candidate kernels at once, in parallel processes (one kernel per plan); a
        failure only means that they compile one by one as they are first run."""
        try:
            kernel.precompile(network_plans(tuner.net))
        except Exception as error:  # e.g. no writable cache directory or a worker that cannot start
            warnings.warn(f"register-tiled kernels not precompiled ({error}); they compile one by one", stacklevel=3)

    def variants(self, step: SparseConvStep, sample: TuneSample, tuner: KernelTuner) -> list[Variant]:
        """One variant per candidate layer, each built and run once (compiled): the one prepared before, else
        the planner's best plans; none where the planner does not support the geometry or the kernel was
        rejected (a failure to build or run is recorded as a rejection)."""
        rejected = self.name in tuner.net.rejected_kernels.get(step.name, {})
        if planner.unsupported_reason(step.weights.geometry) is not None or rejected:
            return []
        try:
            if step.register is not None:
                layers = [step.register]
            else:
                plans = plans_for(step, tuner.net)
                layers = [kernel.RegisterConvLayer.prepare(step.weights, p) for p in plans]
            for layer in layers:
                kernel.conv(sample.dense_input, layer, step.bias, relu=step.relu)  # compiles it
        except Exception as error:  # e.g. an NVRTC that rejects the source: the other kernels still serve
            tuner.reject(step.name, self.name, f"{type(error).__name__}: {error}")
            return []
        run = kernel.conv
        return [
            Variant(
                layer,
                functools.partial(run, sample.dense_input, layer, step.bias, residual=sample.residual, relu=step.relu),
            )
            for layer in layers
        ]


def plans_for(step: SparseConvStep, net: SparseNetwork) -> list[RegisterTilePlan]:
    """The planner's shortlist of `REGISTER_PLANS_TIMED` plans for `step` (none where it cannot run it),
    without pixel runs unless the network allows them."""
    g = step.weights.geometry
    if planner.unsupported_reason(g) is not None:
        return []
    sms = torch.cuda.get_device_properties(net.device).multi_processor_count
    plans = planner.shortlist(g, step.weights.density, sms, REGISTER_PLANS_TIMED)
    return [p for p in plans if net.pixel_runs or not p.pixel_run]


def network_plans(net: SparseNetwork) -> list[RegisterTilePlan]:
    """Every plan `tune` would time on `net`'s layers that have no register layer yet (GPU networks only)."""
    from tendril.sparse.steps import SparseConvStep

    if net.device.type != "cuda" or REGISTER.unsupported_dtype(net.dtype) is not None:
        return []
    return [
        plan
        for step in net.steps
        if isinstance(step, SparseConvStep) and step.register is None
        for plan in plans_for(step, net)
    ]


REGISTER = RegisterKernel()
