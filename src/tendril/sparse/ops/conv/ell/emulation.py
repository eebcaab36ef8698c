"""The `"ell"` kernel's algorithm on the CPU in PyTorch ops, for CI and CPU tensors: the same packed entries,
the same offset arithmetic (flat offsets into the zero-padded input plus each output pixel's base, or
channel × plane + pixel for pointwise layers), padding entries included, the same fp32 accumulation and the
same epilogue (bias, residual, ReLU, the input's dtype, channels put back in their order). Entries are summed
all at once (`index_add_`), not chunk by chunk: only the summation order differs from the kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tendril.sparse.ops.conv.ell.packing import EllConvWeights, padded_hw
from tendril.sparse.validation import segment_of


def pixel_bases(packed: EllConvWeights) -> torch.Tensor:
    """`[OH * OW]` int64: the offset each output pixel adds to an entry's offset (what the kernel's `base` is)."""
    g = packed.geometry
    oh, ow = g.out_hw
    p = torch.arange(oh * ow, device=packed.values.device)
    if packed.pointwise:
        return p
    wp = padded_hw(g)[1]
    return (p // ow) * g.stride[0] * wp + (p % ow) * g.stride[1]


def conv(
    x: torch.Tensor,
    packed: EllConvWeights,
    bias: torch.Tensor,
    residual: torch.Tensor | None = None,
    relu: bool = False,
) -> torch.Tensor:
    """What `kernel.conv` computes, for a batch `x` (`[N, C, H, W]`), in `x`'s dtype."""
    g, cfg = packed.geometry, packed.config
    (ph, pw), (hp, wp) = g.padding, padded_hw(g)
    xp = F.pad(x, (pw, pw, ph, ph)) if ph or pw else x
    flat = xp.reshape(x.shape[0], -1).float()
    per_chunk = cfg.depth * cfg.channels
    used = int(packed.chunk_ptr[-1]) * per_chunk  # the spare chunk is never summed
    entry = torch.arange(used, device=x.device)
    tile = segment_of(packed.chunk_ptr, int(packed.chunk_ptr[-1]))[entry // per_chunk]
    channel = packed.channels.long()[tile * cfg.channels + entry % cfg.channels]
    real = channel >= 0  # lanes past the last output channel hold only padding, which the kernel never stores
    entry, channel = entry[real], channel[real]
    offsets = packed.offsets[entry].long()
    if packed.pointwise:
        offsets = offsets * (hp * wp)
    read = offsets[:, None] + pixel_bases(packed)[None, :]  # [entries, pixels]
    products = packed.values[entry, None] * flat[:, read]  # [N, entries, pixels]
    y = torch.zeros(x.shape[0], g.out_channels, g.out_hw[0] * g.out_hw[1], device=x.device)
    y.index_add_(1, channel, products)
    y = y.view(x.shape[0], g.out_channels, *g.out_hw) + bias.float().view(1, -1, 1, 1)
    if residual is not None:
        y = y + residual.float()
    return (y.relu() if relu else y).to(x.dtype)
