"""The Triton Cartesian kernel as a `ConvKernel` (`"triton"`, and the whole `"triton"` backend): reads
compressed activations and the compressed weights themselves (no copy); any network dtype (fp32 products)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.ops.conv.cartesian_triton import kernel
from tendril.sparse.ops.conv.interface import CompressedInputKernel
from tendril.sparse.validation import VALUE_DTYPES

if TYPE_CHECKING:
    from tendril.sparse.steps import RunState, SparseConvStep


class CartesianTritonKernel(CompressedInputKernel):
    name = "triton"
    dtypes = VALUE_DTYPES

    def convolve(
        self, step: SparseConvStep, acts: CompressedActivations, init: torch.Tensor, state: RunState
    ) -> torch.Tensor:
        y = kernel.conv(acts, step.weights, init)
        return y.relu_() if step.relu else y


CARTESIAN_TRITON = CartesianTritonKernel()
