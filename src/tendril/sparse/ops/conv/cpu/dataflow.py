"""The CPU kernels as a `ConvKernel` (the `"cpu"` backend's only one, never tuned): they read the dense input,
compress it only for SCNN's dataflow, and fuse bias, residual and ReLU (`kernel.conv_dense_input`). The weights
in both dataflows' orders (`CpuConvPlan`, the layer's `cpu_plan`) are built on the first CPU forward. Unpadded 1×1
layers count their input's nonzeros only where a count is reported or could overflow the layout's capacity (as the
GPU's dense-input kernels count only for the layer report).

A layer runs through its `PreparedConv` (`prepared.py`), built on its first call under a `RunState` and kept there,
for inputs of the batch size and shape it was built for; any other input takes `run_unprepared`, the same kernels
called through `conv_dense_input`, which raises its errors for a shape the layer cannot take."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tendril.sparse.ops.conv.cpu import kernel
from tendril.sparse.ops.conv.cpu.prepared import PreparedConv
from tendril.sparse.ops.conv.interface import ConvKernel

if TYPE_CHECKING:
    from tendril.sparse.steps import RunState, SparseConvStep


class CpuKernel(ConvKernel):
    name = "cpu"

    def run(
        self, step: SparseConvStep, x: torch.Tensor, residual: torch.Tensor | None, state: RunState
    ) -> torch.Tensor:
        prepared = state.prepared.get(id(step))
        if prepared is None or not prepared.accepts(x):
            if not _preparable(step, x):
                return run_unprepared(step, x, residual, state)
            prepared = state.prepared[id(step)] = PreparedConv(step, state, x.shape[0])
        return prepared(x, residual, state)


def _preparable(step: SparseConvStep, x: torch.Tensor) -> bool:
    """Whether `x` is a batch of the layer's input shape that a `PreparedConv` can take (fp32, on the CPU)."""
    g = step.weights.geometry
    return (
        x.dim() == 4
        and tuple(x.shape[1:]) == (g.in_channels, *g.in_hw)
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    )


def run_unprepared(
    step: SparseConvStep, x: torch.Tensor, residual: torch.Tensor | None, state: RunState
) -> torch.Tensor:
    """The layer's output by `kernel.conv_dense_input`, sample by sample, everything derived anew (inputs a prepared
    call does not take; the reference its outputs are checked against)."""
    if step.cpu_plan is None:
        step.cpu_plan = kernel.CpuConvPlan.prepare(step.weights)
    g = step.weights.geometry
    y = torch.empty(x.shape[0], g.out_channels, *g.out_hw)
    for b in range(x.shape[0]):
        counts = kernel.conv_dense_input(
            x[b],
            step.cpu_plan,
            step.bias,
            out=y[b],
            layout=step.layout,
            residual=None if residual is None else residual[b],
            relu=step.relu,
            threads=state.threads,
            count=state.count_inputs or step.layout.capacity < step.layout.plane_size,
            library=state.library,
        )
        if counts is not None:
            state.count(step.name, counts, step.layout)
    return y


CPU = CpuKernel()
