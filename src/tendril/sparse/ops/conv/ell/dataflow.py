"""The ELL kernel as a `ConvKernel` (`"ell"`): reads the layer's dense input in its dtype (no compression, so no
capacity to overflow) and its `EllConvWeights` (held in the layer's `ell` attribute: the weights packed for one
tile config), and fuses bias, residual and ReLU.

`tune` times one variant per tile config in `CONFIGS` that suits the layer (`configs_for`), each with its own
packing, and keeps the fastest one's; it admits the kernel only once its output agrees with the layer's
reference. Every geometry the compressed layout holds is supported (any stride, padding, groups), within int32
offsets (`unsupported_reason`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from tendril.sparse.format import ConvGeometry
from tendril.sparse.ops.conv.ell import kernel
from tendril.sparse.ops.conv.ell.packing import EllConfig, pack
from tendril.sparse.ops.conv.ell.planes import plane_hw, planes_per_channel, virtual_width
from tendril.sparse.ops.conv.interface import ConvKernel, TuneSample, Variant
from tendril.sparse.validation import VALUE_DTYPES

if TYPE_CHECKING:
    from tendril.sparse.steps import RunState, SparseConvStep
    from tendril.sparse.tuning import KernelTuner

CONFIGS = (
    EllConfig(channels=4, depth=8, pixels=256, warps=4, run=32),
    EllConfig(channels=8, depth=8, pixels=128, warps=4, run=32),
    EllConfig(channels=8, depth=8, pixels=128, warps=4),
    EllConfig(channels=4, depth=8, pixels=128, warps=4),
    EllConfig(channels=16, depth=4, pixels=64, warps=4),
    EllConfig(channels=8, depth=8, pixels=64, warps=4),
    EllConfig(channels=4, depth=16, pixels=64, warps=4),
    EllConfig(channels=2, depth=16, pixels=64, warps=2),
    EllConfig(channels=4, depth=16, pixels=64, warps=4, splits=4),
    EllConfig(channels=2, depth=16, pixels=64, warps=2, splits=8),
)
"""The tile configs `tune` times: long pixel blocks for large planes (a thread then holds 8 or 16 pixels of each
nonzero it loads), also with whole-warp runs (`run=32`: a load instruction reads one nonzero's 32 consecutive
inputs, one or two cache lines, where runs of 8 touch four nonzeros' lines); wide channel tiles with shallow
steps for channels with few nonzeros; narrow, deep ones for channels with many (fewer loop steps, each with
more loads in flight) and for small planes, where only narrow tiles make enough programs to fill the GPU; and
for small planes of long channels (deep layers), tiles whose chunks are split between programs, the loop's
length divided by `splits` (`configs_for`). A thread's accumulator holds 32 or 64 fp32 values."""
FEW_PROGRAMS = 1024
"""Below this many programs (tiles × pixel blocks) a layer is also timed with the split configs."""


def unsupported_reason(geometry: ConvGeometry) -> str | None:
    """Why the kernel cannot run a layer of `geometry` (None: it can): its int32 offsets must reach every element
    of a sample's input planes (`planes.py`), and the virtual pixels of its last pixel block past them."""
    rows, cols = plane_hw(geometry)
    elements = geometry.in_channels * planes_per_channel(geometry) * rows * cols
    if elements + geometry.out_hw[0] * virtual_width(geometry) >= 1 << 31:
        return f"a sample's input planes of {elements} elements exceed int32 offsets"
    return None


def configs_for(step: SparseConvStep) -> list[EllConfig]:
    """The configs worth timing on `step`: those whose pixel run is not longer than the output plane needs (else
    the shortest); of those, the ones whose depth is not past the mean nonzero count of a channel, which would be
    mostly padding (else the shallowest); split ones only where the layer makes fewer than `FEW_PROGRAMS`
    programs unsplit and a channel's mean count fills two steps of each split."""
    g = step.weights.geometry
    pixels = g.out_hw[0] * virtual_width(g)
    plane = 1 << (pixels - 1).bit_length()
    mean_nnz = max(4, -(-step.weights.nnz // g.out_channels))
    shortest = min(c.pixels for c in CONFIGS)
    fitting = [c for c in CONFIGS if c.pixels <= max(plane, shortest)]
    shallowest = min(c.depth for c in fitting)

    def worth_splitting(c: EllConfig) -> bool:
        programs = -(-g.out_channels // c.channels) * -(-pixels // c.pixels)
        return programs < FEW_PROGRAMS and mean_nnz >= 2 * c.splits * c.depth

    kept = [c for c in fitting if c.depth <= max(mean_nnz, shallowest)]
    return [c for c in kept if c.splits == 1 or worth_splitting(c)]


class EllKernel(ConvKernel):
    name = "ell"
    reads = "ell"
    checked = True
    kept_after_tune = False
    dtypes = VALUE_DTYPES

    def run(
        self, step: SparseConvStep, x: torch.Tensor, residual: torch.Tensor | None, state: RunState
    ) -> torch.Tensor:
        packed = step.ell
        if packed is None:
            raise ValueError(f"{step.name}: the ell kernel was chosen but not prepared; SparseNetwork.tune builds it")
        if state.count_inputs:
            state.last_counts[step.name] = torch.count_nonzero(x[-1]).view(1)
        return kernel.conv(x, packed, step.bias, residual=residual, relu=step.relu)

    def variants(self, step: SparseConvStep, sample: TuneSample, tuner: KernelTuner) -> list[Variant]:
        """One variant per config of `configs_for` (or the one packed before), each packed from the layer's
        compressed weights; none where the geometry is unsupported or the kernel was rejected on this layer."""
        rejected = self.name in tuner.net.rejected_kernels.get(step.name, {})
        if unsupported_reason(step.weights.geometry) is not None or rejected:
            return []
        packs = [step.ell] if step.ell is not None else [pack(step.weights, c) for c in configs_for(step)]
        x = sample.dense_input[None]
        residual = None if sample.residual is None else sample.residual[None]
        return [
            Variant(packed, functools.partial(kernel.conv, x, packed, step.bias, residual=residual, relu=step.relu))
            for packed in packs
        ]


ELL = EllKernel()
