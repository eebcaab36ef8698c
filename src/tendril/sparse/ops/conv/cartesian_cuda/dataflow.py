"""The shared-memory Cartesian kernel as a `ConvKernel` (`"cuda"`, the default on a GPU): reads compressed
activations and the weights in tile order (`TiledWeights`, the layer's `tiled`, built at conversion)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import SparseConvWeights
from tendril.sparse.ops.conv.cartesian_cuda import kernel, tiling
from tendril.sparse.ops.conv.cartesian_cuda.tiling import TiledWeights
from tendril.sparse.ops.conv.interface import CompressedInputKernel

if TYPE_CHECKING:
    from tendril.sparse.steps import RunState, SparseConvStep


class CartesianCudaKernel(CompressedInputKernel):
    name = "cuda"
    reads = "tiled"

    def prepare(self, weights: SparseConvWeights) -> TiledWeights:
        """The weights in tile order for this device: tiles planned for two thread blocks per SM."""
        blocks = 2 * torch.cuda.get_device_properties(weights.values.device).multi_processor_count
        return TiledWeights.prepare(weights, tiling.plan(weights.geometry, target_blocks=blocks))

    def convolve(
        self, step: SparseConvStep, acts: CompressedActivations, init: torch.Tensor, state: RunState
    ) -> torch.Tensor:
        if step.tiled is None:
            raise ValueError(
                f"{step.name}: the cuda kernel's tile-ordered weights are not held (a CPU conversion, or "
                "released by SparseNetwork.release_unused_kernels)"
            )
        return kernel.conv(acts, step.weights, step.tiled, init, relu=step.relu)


CARTESIAN_CUDA = CartesianCudaKernel()
