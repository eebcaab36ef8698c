"""Sparse CNN inference (after cuSCNN): compressed weights and activations, sparse×sparse kernels.

from tendril.sparse import prune, convert
prune(model, "vgg16")                     # Deep Compression densities, in place
net = convert(model.eval(), example)      # runs on the model's device
y = net(x)                                # matches model(x) on the same pruned weights
"""

from tendril.sparse.convert import UnsupportedLayerError, convert
from tendril.sparse.network import ActivationOverflowError, LayerReport, SparseNetwork
from tendril.sparse.prune import DEEP_COMPRESSION, PrunedLayer, prune

__all__ = [
    "DEEP_COMPRESSION",
    "ActivationOverflowError",
    "LayerReport",
    "PrunedLayer",
    "SparseNetwork",
    "UnsupportedLayerError",
    "convert",
    "prune",
]
