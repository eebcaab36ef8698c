"""Cases and checks of the `"ell"` convolution kernel shared by its CPU, interpreted and GPU tests: random
sparse weights with one output channel left without nonzeros, random inputs in the tested dtype, NaN-poisoned
outputs, the float64 reference on the same (rounded) inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.ops.conv.ell import kernel as ell_kernel
from tendril.sparse.ops.conv.ell.packing import EllConfig, pack

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
"""Largest relative error (Frobenius norm) against the float64 reference: fp32 accumulation, rounded once to
the output dtype."""


@dataclass(frozen=True)
class EllCase:
    channels: int
    out_channels: int
    size: tuple[int, int]
    kernel: tuple[int, int]
    stride: int
    padding: int
    density: float
    groups: int = 1
    batch: int = 1
    residual: bool = False
    relu: bool = False
    seed: int = 0

    @property
    def geometry(self) -> ConvGeometry:
        return ConvGeometry(
            self.channels,
            self.out_channels,
            self.kernel,
            (self.stride, self.stride),
            (self.padding, self.padding),
            self.groups,
            self.size,
        )


CASES = [
    EllCase(6, 10, (5, 7), (1, 1), 1, 0, 0.3, batch=2, residual=True, relu=True),  # pointwise
    EllCase(5, 7, (7, 6), (1, 1), 2, 0, 0.5, relu=True),  # strided 1×1 (downsample)
    EllCase(4, 9, (6, 5), (3, 3), 1, 1, 0.5, relu=True),
    EllCase(5, 6, (7, 7), (3, 3), 2, 1, 0.2, batch=2, residual=True, relu=True),
    EllCase(4, 6, (9, 8), (5, 5), 2, 2, 0.3, groups=2),
    EllCase(3, 5, (13, 11), (7, 7), 2, 3, 0.3, relu=True),  # a stem: 7×7, stride 2
    EllCase(3, 4, (19, 17), (11, 11), 4, 2, 0.3),  # stride 4
    EllCase(4, 6, (8, 9), (3, 3), 2, 0, 0.4, residual=True),  # strided, unpadded
    EllCase(3, 5, (6, 6), (3, 1), 1, 0, 1.0, residual=True),
    EllCase(4, 5, (5, 5), (3, 3), 1, 1, 0.0, relu=True),  # no nonzeros at all: bias (+ ReLU) only
    EllCase(8, 17, (4, 4), (3, 3), 1, 1, 0.05, relu=True),  # most channels empty, a tile's lanes unused
]
SMALL_CONFIGS = [
    EllConfig(4, 2, 16, 1),
    EllConfig(2, 4, 32, 1, splits=2),
    EllConfig(8, 2, 16, 2),
    EllConfig(4, 2, 16, 1, splits=4),
    EllConfig(2, 2, 32, 1, run=16),
    EllConfig(2, 2, 32, 1, splits=2, run=32),
]
"""Tile configs small enough for the tiny cases to span several channel tiles, pixel blocks and chunks."""


def operands(case: EllCase, dtype: torch.dtype, device: torch.device):
    """`(weights, x, bias, residual, reference)`: the reference is float64 on the inputs as rounded to `dtype`."""
    gen = torch.Generator().manual_seed(case.seed)
    g = case.geometry
    shape = (g.out_channels, g.in_channels // g.groups, *g.kernel)
    weight = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < case.density)
    weight[min(1, g.out_channels - 1)] = 0  # an output channel without nonzeros
    x = torch.randn(case.batch, g.in_channels, *g.in_hw, generator=gen).to(dtype)
    bias = torch.randn(g.out_channels, generator=gen)
    out_shape = (case.batch, g.out_channels, *g.out_hw)
    residual = torch.randn(out_shape, generator=gen).to(dtype) if case.residual else None
    ref = F.conv2d(x.double(), weight.double(), bias.double(), g.stride, g.padding, groups=g.groups)
    if residual is not None:
        ref = ref + residual.double()
    if case.relu:
        ref = ref.relu()
    weights = SparseConvWeights.from_dense(weight.to(device), g)
    residual = None if residual is None else residual.to(device)
    return weights, x.to(device), bias.to(device), residual, ref


def relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def check_case(case: EllCase, config: EllConfig, dtype: torch.dtype, device: torch.device) -> float:
    """Run the kernel on `case` with `config` into a NaN-poisoned output; assert every element was written and the
    error is within `TOLERANCE`; return the error."""
    weights, x, bias, residual, ref = operands(case, dtype, device)
    packed = pack(weights, config)
    out = torch.full(tuple(ref.shape), float("nan"), dtype=dtype, device=device)
    y = ell_kernel.conv(x, packed, bias, residual=residual, relu=case.relu, out=out)
    assert y is out and y.dtype == dtype
    assert torch.isfinite(y).all(), f"{case} {config} {dtype}: unwritten outputs"
    error = relative_error(y, ref)
    assert error <= TOLERANCE[dtype], f"{case} {config} {dtype}: relative error {error:.2e}"
    return error
