"""Plain-PyTorch reference of the sparse fully-connected layer: densify and multiply."""

from __future__ import annotations

import torch

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import SparseLinearWeights
from tendril.sparse.ops.compress.reference import decompress


def linear(acts: CompressedActivations, weights: SparseLinearWeights, init: torch.Tensor) -> torch.Tensor:
    """`init + W @ a` for a compressed activation vector (`init` carries the bias)."""
    x = decompress(acts).flatten()
    return init + weights.to_dense() @ x
