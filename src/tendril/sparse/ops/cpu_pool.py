"""Pooling for CPU networks: max pooling compiled (fp32) or as separable maxima of strided views (other dtypes), and
global average pooling compiled (fp32).

torch's `max_pool2d` on a contiguous (NCHW) CPU tensor runs a scalar loop per output pixel, at batch 1 an order
of magnitude slower than a pass over the input; in a CPU network it can cost as much as a sparse convolution
layer. For fp32 (the CPU backend's dtype) the pool is a compiled loop on numba's pool
(`cpu_kernels.max_pool_planes`), parallel over planes with the network's thread count: torch stays on one thread
during a CPU forward (`cpu_threads`), so a torch-op pool would run serially. Other dtypes take separable maxima:
the maximum over a `kh × kw` window is the maximum over `kw` columns of the maxima over `kh` rows, so
`max_pool(x)` is `kh - 1` elementwise `torch.maximum`s of row-strided views, then `kw - 1` of column-strided views
of that, every one a vectorized pass. Either way the padding is implicit `-inf`, as in torch's, and NaNs propagate
as they do there.

An `AdaptiveAvgPool2d` to one pixel (ResNet's pooling before its FC layer) is the mean of each plane: for fp32 a
compiled pass parallel over planes (`cpu_kernels.mean_planes`), for the same reason: torch's own, on one thread
between two compiled layers, costs many times its single pass. One to the input's own size (VGG's, at 224×224) is
a copy.

`pooling(module)` wraps a `MaxPool2d` whose options this covers (no dilation, no `ceil_mode`, no indices) and an
`AdaptiveAvgPool2d`, so that CPU tensors take these paths and other devices the module itself; any other module is
returned as it is.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tendril.sparse.ops.cpu_threads import kernels


class SeparableMaxPool:
    """`module(x)` for a supported `nn.MaxPool2d`, computed separably on CPU tensors."""

    def __init__(self, module: nn.MaxPool2d) -> None:
        self.module = module
        self.kernel, self.stride = _pair(module.kernel_size), _pair(module.stride)
        self.padding = _pair(module.padding)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu:
            return self.module(x)
        return max_pool(x, self.kernel, self.stride, self.padding)


class AdaptiveAvgPool:
    """`module(x)` for an `nn.AdaptiveAvgPool2d`: on fp32 CPU tensors, to one pixel compiled (`global_avg_pool`), and
    to the input's own size a copy (each window one pixel: VGG's pooling to 7×7 of a 7×7 input); otherwise the
    module."""

    def __init__(self, module: nn.AdaptiveAvgPool2d) -> None:
        self.module = module

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_cpu or x.dtype != torch.float32 or x.shape[-1] * x.shape[-2] == 0:
            return self.module(x)
        size = _output_size(self.module, x)
        if size == (1, 1):
            return global_avg_pool(x)
        if size == tuple(x.shape[-2:]):
            return x.clone()
        return self.module(x)


def pooling(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The callable a network runs for a pooling module: `SeparableMaxPool` where it covers the module,
    `AdaptiveAvgPool` for adaptive average pooling."""
    if isinstance(module, nn.MaxPool2d) and _separable(module):
        return SeparableMaxPool(module)
    if isinstance(module, nn.AdaptiveAvgPool2d):
        return AdaptiveAvgPool(module)
    return module


def global_avg_pool(x: torch.Tensor) -> torch.Tensor:
    """`F.adaptive_avg_pool2d(x, 1)` of an fp32 CPU tensor with nonempty planes: each plane's mean, compiled."""
    x = x.detach() if x.requires_grad else x
    planes = (x if x.is_contiguous() else x.contiguous()).numpy().reshape(-1, x.shape[-2] * x.shape[-1])
    out = torch.empty(*x.shape[:-2], 1, 1)
    kernels().mean_planes(planes, out.numpy().reshape(-1))
    return out


def max_pool(
    x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], padding: tuple[int, int]
) -> torch.Tensor:
    """`F.max_pool2d(x, kernel, stride, padding)` (floor mode, no dilation) of a CPU tensor: compiled for fp32,
    separable strided maxima otherwise."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    height, width = x.shape[-2] + 2 * ph, x.shape[-1] + 2 * pw
    oh, ow = (height - kh) // sh + 1, (width - kw) // sw + 1
    if oh < 1 or ow < 1:
        raise ValueError(f"x: a {height}×{width} plane (padded) is smaller than the {kh}×{kw} pooling window")
    if x.dtype == torch.float32:
        x = x.detach() if x.requires_grad else x
        planes = (x if x.is_contiguous() else x.contiguous()).numpy().reshape(-1, *x.shape[-2:])
        out = torch.empty(*x.shape[:-2], oh, ow)
        kernels().max_pool_planes(planes, out.numpy().reshape(-1, oh, ow), kh, kw, sh, sw, ph, pw)
        return out
    if ph or pw:
        x = F.pad(x, (pw, pw, ph, ph), value=float("-inf"))
    rows = x[..., 0 : (oh - 1) * sh + 1 : sh, :]
    for i in range(1, kh):
        rows = torch.maximum(rows, x[..., i : i + (oh - 1) * sh + 1 : sh, :])
    out = rows[..., 0 : (ow - 1) * sw + 1 : sw]
    for j in range(1, kw):
        out = torch.maximum(out, rows[..., j : j + (ow - 1) * sw + 1 : sw])
    return out.contiguous()


def _separable(module: nn.MaxPool2d) -> bool:
    return _pair(module.dilation) == (1, 1) and not module.ceil_mode and not module.return_indices


def _output_size(module: nn.AdaptiveAvgPool2d, x: torch.Tensor) -> tuple[int, int]:
    """The module's output size for `x` (None keeps the input's size in that dimension)."""
    size = module.output_size
    pair = (size, size) if isinstance(size, int) or size is None else (size[0], size[-1])
    return (pair[0] or x.shape[-2], pair[1] or x.shape[-1])


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    if isinstance(value, int):
        return value, value
    return value[0], value[-1]
