"""Plain-PyTorch reference of the sparse convolution: densify both operands and call `F.conv2d`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import SparseConvWeights
from tendril.sparse.ops.compress.reference import decompress


def conv(acts: CompressedActivations, weights: SparseConvWeights, init: torch.Tensor) -> torch.Tensor:
    """`init + conv(acts, weights)`: `init` (`[K, OH, OW]`) carries the bias and any fused residual."""
    g = weights.geometry
    x = decompress(acts)[None]
    y = F.conv2d(x, weights.to_dense(), stride=g.stride, padding=g.padding, groups=g.groups)[0]
    return init + y
