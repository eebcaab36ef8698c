"""The GEMM convolution as a `ConvKernel` (`"gemm"`): a dense fallback like cuDNN's (`DenseWeightKernel`), for
ungrouped layers only."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tendril.sparse.ops.conv.dense.dataflow import DenseWeightKernel
from tendril.sparse.ops.conv.gemm import kernel

if TYPE_CHECKING:
    from tendril.sparse.steps import SparseConvStep


class GemmKernel(DenseWeightKernel):
    name = "gemm"

    def serves(self, step: SparseConvStep) -> bool:
        return kernel.supports(step.weights.geometry)

    def compute(
        self, step: SparseConvStep, weight: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor:
        return kernel.conv(x, weight, step.bias, step.weights.geometry, residual=residual, relu=step.relu)


GEMM = GemmKernel()
