"""The `"ell"` kernel's algorithm on the CPU in PyTorch ops, for CI and CPU tensors: the same packed entries
read from the same input planes (`planes.input_planes`) at the same offsets (every virtual pixel computed, only
the output's stored), padding entries included, the same fp32 accumulation and the same epilogue (bias,
residual, ReLU, the input's dtype, channels put back in their order). Entries are summed all at once
(`index_add_`), not chunk by chunk: only the summation order differs from the kernel.
"""

from __future__ import annotations

import torch

from tendril.sparse.ops.conv.ell.packing import EllConvWeights
from tendril.sparse.ops.conv.ell.planes import POINTWISE, input_planes, plane_hw, virtual_width
from tendril.sparse.validation import segment_of


def conv(
    x: torch.Tensor,
    packed: EllConvWeights,
    bias: torch.Tensor,
    residual: torch.Tensor | None = None,
    relu: bool = False,
) -> torch.Tensor:
    """What `kernel.conv` computes, for a batch `x` (`[N, C, H, W]`), in `x`'s dtype."""
    g, cfg = packed.geometry, packed.config
    flat = input_planes(x, g).reshape(x.shape[0], -1).float()
    per_chunk = cfg.depth * cfg.channels
    used = int(packed.chunk_ptr[-1]) * per_chunk  # the spare chunk is never summed
    entry = torch.arange(used, device=x.device)
    tile = segment_of(packed.chunk_ptr, int(packed.chunk_ptr[-1]))[entry // per_chunk]
    channel = packed.channels.long()[tile * cfg.channels + entry % cfg.channels]
    real = channel >= 0  # lanes past the last output channel hold only padding, which the kernel never stores
    entry, channel = entry[real], channel[real]
    offsets = packed.offsets[entry].long()
    if packed.mode == POINTWISE:
        rows, cols = plane_hw(g)
        offsets = offsets * (rows * cols)
    (oh, ow), vw = g.out_hw, virtual_width(g)
    read = offsets[:, None] + torch.arange(oh * vw, device=x.device)[None, :]  # [entries, virtual pixels]
    products = packed.values[entry, None] * flat[:, read]  # [N, entries, virtual pixels]
    y = torch.zeros(x.shape[0], g.out_channels, oh * vw, device=x.device)
    y.index_add_(1, channel, products)
    y = y.view(x.shape[0], g.out_channels, oh, vw)[..., :ow] + bias.float().view(1, -1, 1, 1)
    if residual is not None:
        y = y + residual.float()
    return (y.relu() if relu else y).to(x.dtype)
