"""A convolution as one dense matrix product on the pruned weights (cuBLAS in the network's dtype: fp32, or fp16 /
bf16 with fp32 accumulation), for layers where that beats
every sparse kernel and cuDNN.

At batch 1 a convolution is `W[K, C*R*S] @ cols[C*R*S, OH*OW]`. cuDNN's fp32 kernels can be slow on the small,
deep layers of networks like ResNet-50 where cuBLAS is not; `SparseNetwork.tune` measures both per layer (the
`sparse-cnn` benchmark reports which layers chose it). The columns are:
- a view of the input for a 1×1 kernel with stride 1 and no padding (no copy);
- the input subsampled (one copy) for a 1×1 kernel with a stride, without padding;
- `F.unfold` (im2col, one copy) otherwise.

Bias, residual and ReLU are one Triton epilogue over the product, in place (`epilogue_`): two kernels per layer,
three with im2col. On the CPU (tests) the epilogue is PyTorch's ops, unless the Triton interpreter runs the
kernel. Grouped convolutions are not supported (`supports`). TF32 is the caller's to rule out
(`tendril.sparse.ops.conv.dense.dataflow.fp32_dense_math`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tendril import config
from tendril.sparse.format import ConvGeometry

EPILOGUE_BLOCK = 1024


def supports(geometry: ConvGeometry) -> bool:
    return geometry.groups == 1


def columns(x: torch.Tensor, geometry: ConvGeometry) -> torch.Tensor:
    """`x` (`[B, C, H, W]`) as the product's right operand, `[B, C*R*S, OH*OW]` in `F.unfold`'s order."""
    g = geometry
    if g.kernel == (1, 1) and g.padding == (0, 0):
        if g.stride != (1, 1):
            x = x[:, :, :: g.stride[0], :: g.stride[1]]
        return x.reshape(x.shape[0], x.shape[1], -1)
    return F.unfold(x, g.kernel, padding=g.padding, stride=g.stride)


def conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    geometry: ConvGeometry,
    residual: torch.Tensor | None = None,
    relu: bool = False,
) -> torch.Tensor:
    """`relu(conv2d(x, weight) + bias + residual)` for a batch `x` and dense `weight` (`[K, C, R, S]`)."""
    if not supports(geometry):
        raise ValueError(f"the GEMM convolution does not support groups={geometry.groups}")
    g = geometry
    y = torch.matmul(weight.view(g.out_channels, -1), columns(x, g))
    epilogue_(y, bias, residual, relu)
    return y.view(x.shape[0], g.out_channels, *g.out_hw)


def epilogue_(y: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor | None, relu: bool) -> None:
    """In place on a contiguous `y` (`[B, K, L]`): add `bias` (`[K]`) per channel and `residual` (any contiguous
    tensor of `y`'s size), then ReLU; in fp32 registers, stored in `y`'s dtype."""
    if not y.is_contiguous() or y.dim() != 3 or bias.shape != (y.shape[1],):
        raise ValueError(f"epilogue of a contiguous [B, K, L] product with a [K] bias, got {tuple(y.shape)}")
    if residual is not None and residual.numel() != y.numel():
        raise ValueError(f"residual of {residual.numel()} elements for a product of {y.numel()}")
    if y.device.type == "cpu" and not config.settings.triton_interpret:
        y.add_(bias.view(1, -1, 1))
        if residual is not None:
            y.add_(residual.view_as(y))
        if relu:
            y.relu_()
        return
    res = y if residual is None else residual.contiguous()
    grid = (triton.cdiv(y.numel(), EPILOGUE_BLOCK),)
    _epilogue_kernel[grid](y, bias, res, y.numel(), y.shape[1], y.shape[2], residual is not None, relu, EPILOGUE_BLOCK)


@triton.jit
def _epilogue_kernel(
    y_ptr,
    bias_ptr,
    residual_ptr,
    numel,
    channels,
    length,
    HAS_RESIDUAL: tl.constexpr,
    RELU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    v = tl.load(y_ptr + offs, mask=mask).to(tl.float32)
    v += tl.load(bias_ptr + (offs // length) % channels, mask=mask).to(tl.float32)
    if HAS_RESIDUAL:
        v += tl.load(residual_ptr + offs, mask=mask).to(tl.float32)
    if RELU:
        v = tl.maximum(v, 0.0)
    tl.store(y_ptr + offs, v, mask=mask)
