"""Checks of half-precision (fp16, bf16) networks and kernels, shared by the Triton-interpreter and GPU tests.

Every reference is float64 on the *rounded* operands (the weights and inputs as the network's dtype holds them), so
what is measured is the kernels' own error: none beyond fp32 summation where a kernel returns its fp32
accumulator (products of two half values are exact in fp32), and the output's rounding to the dtype where it
returns the network's dtype (`OUTPUT_TOL`). Whole networks also round every intermediate activation
(`NETWORK_TOL`). Errors are relative L2 (Frobenius) norms.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from tendril.sparse.activations import ActivationLayout
from tendril.sparse.format import SparseConvWeights, SparseLinearWeights
from tendril.sparse.ops.compress import reference as compress_reference
from tests.sparse.checks import ConvCase, assert_same_compression, poisoned, sparse_tensor

HALF_DTYPES = (torch.float16, torch.bfloat16)
ACCUMULATOR_TOL = 1e-5
"""An fp32 accumulator of exact products against float64."""
OUTPUT_TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}
"""One rounding of the output to the dtype (unit roundoff 2^-11 for fp16, 2^-8 for bf16)."""
NETWORK_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
"""A whole network, each layer's output rounded to the dtype."""


def relative_l2(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double().cpu()
    return float((y.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def _conv_operands(case: ConvCase, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(case.seed)
    g = case.geometry
    weight = sparse_tensor((g.out_channels, g.in_channels // g.groups, *g.kernel), case.weight_density, gen).to(dtype)
    x = sparse_tensor((g.in_channels, *g.in_hw), case.act_density, gen, positive=True).to(dtype)
    bias = torch.randn(g.out_channels, generator=gen)
    ref = F.conv2d(x[None].double(), weight.double(), bias.double(), g.stride, g.padding, groups=g.groups)[0]
    weights = SparseConvWeights.from_dense(weight.to(device), g)
    assert weights.values.dtype == dtype
    init = bias.view(-1, 1, 1).expand(g.out_channels, *g.out_hw).contiguous().to(device)
    return weights, x.to(device), init, ref


def check_conv_half(case: ConvCase, compress, conv, dtype: torch.dtype, device: torch.device) -> None:
    """`compress(x, layout)` of a `dtype` activation keeps its dtype and agrees with the reference compression;
    `conv(acts, weights, init)` accumulates into the fp32 `init` and matches float64 `F.conv2d`."""
    weights, x, init, ref = _conv_operands(case, dtype, device)
    layout = ActivationLayout.for_conv(weights.geometry)
    acts = compress(x, layout)
    assert acts.values.dtype == dtype
    assert_same_compression(acts, compress_reference.compress(x.cpu(), layout))
    y = conv(poisoned(acts), weights, init)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert relative_l2(y, ref) <= ACCUMULATOR_TOL if ref.abs().max() > 0 else not y.any(), case


def check_linear_half(features: int, outputs: int, compress, linear, dtype: torch.dtype, device: torch.device) -> None:
    """The Cartesian FC kernel on `dtype` values into an fp32 accumulator."""
    gen = torch.Generator().manual_seed(features)
    weight = sparse_tensor((outputs, features), 0.4, gen).to(dtype)
    x = sparse_tensor((features,), 0.5, gen, positive=True).to(dtype)
    bias = torch.randn(outputs, generator=gen)
    ref = weight.double() @ x.double() + bias.double()
    weights = SparseLinearWeights.from_dense(weight.to(device))
    acts = compress(x.to(device).view(1, 1, features), ActivationLayout.for_vector(features))
    y = linear(poisoned(acts), weights, bias.to(device).clone())
    assert y.dtype == torch.float32
    assert relative_l2(y, ref) <= ACCUMULATOR_TOL


def check_linear_rows_half(features: int, outputs: int, dtype: torch.dtype, device: torch.device, config=None) -> None:
    """The row FC kernel on `dtype` weights, input and bias: fp32 sums, the output in `dtype`."""
    from tendril.sparse.ops.linear import triton as linear_triton

    gen = torch.Generator().manual_seed(features + outputs)
    weight = sparse_tensor((outputs, features), 0.4, gen).to(dtype)
    x = sparse_tensor((features,), 0.5, gen, positive=True).to(dtype)
    bias = torch.randn(outputs, generator=gen).to(dtype)
    ref = (weight.double() @ x.double() + bias.double()).relu()
    csr = SparseLinearWeights.from_dense(weight.to(device)).to_csr()
    config = config or linear_triton.RowsConfig(block_r=4, block_k=16)
    y = linear_triton.linear_rows(x.to(device), csr, bias.to(device), relu=True, config=config)
    assert y.dtype == dtype
    assert relative_l2(y, ref) <= OUTPUT_TOL[dtype]


def check_conv_gemm_half(case: ConvCase, dtype: torch.dtype, device: torch.device) -> None:
    """The GEMM convolution (product in `dtype`, Triton epilogue in fp32) with bias, residual and ReLU."""
    from tendril.sparse.ops.conv.gemm import kernel as conv_gemm

    gen = torch.Generator().manual_seed(case.seed + 7)
    g = case.geometry
    weight = sparse_tensor((g.out_channels, g.in_channels, *g.kernel), case.weight_density, gen).to(dtype)
    x = sparse_tensor((2, g.in_channels, *g.in_hw), case.act_density, gen, positive=True).to(dtype)
    bias = torch.randn(g.out_channels, generator=gen).to(dtype)
    resid = torch.randn(2, g.out_channels, *g.out_hw, generator=gen).to(dtype)
    ref = (F.conv2d(x.double(), weight.double(), bias.double(), g.stride, g.padding) + resid.double()).relu()
    y = conv_gemm.conv(x.to(device), weight.to(device), bias.to(device), g, residual=resid.to(device), relu=True)
    assert y.dtype == dtype and y.shape == ref.shape
    assert relative_l2(y, ref) <= OUTPUT_TOL[dtype], case


def check_network_half(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype, net) -> torch.Tensor:
    """`net` (converted from `model` in `dtype`) against the float64 model on the same rounded weights and input;
    returns the float64 reference."""
    reference_model = copy.deepcopy(model).double()
    with torch.no_grad():
        ref = reference_model(x.double())
        y = net(x)
    assert y.dtype == dtype
    assert relative_l2(y, ref) <= NETWORK_TOL[dtype]
    return ref

