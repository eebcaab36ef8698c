"""Triton kernels run on the CPU by the Triton interpreter; executed by test_triton_interpreted.py in a
subprocess with TRITON_INTERPRET=1 (the variable must be set before the kernels are defined)."""

from __future__ import annotations

import os

import torch

from tendril.sparse import convert, prune
from tendril.sparse.activations import ActivationLayout
from tendril.sparse.ops.compress import reference as compress_reference
from tendril.sparse.ops.compress import triton as compress_triton
from tendril.sparse.ops.conv.cartesian_triton import kernel as conv_triton
from tendril.sparse.ops.linear import triton as linear_triton
from tests.sparse.checks import (
    CONV_CASES,
    GEMM_CASES,
    REL_TOL,
    assert_same_compression,
    check_conv,
    check_conv_gemm,
    check_linear,
    check_linear_rows,
    relative_error,
)
from tests.sparse.half_checks import (
    HALF_DTYPES,
    check_conv_gemm_half,
    check_conv_half,
    check_linear_half,
    check_linear_rows_half,
    check_network_half,
)
from tests.sparse.models import Bottleneck, ResNetLike, randomize_batchnorm, vgg_like

CPU = torch.device("cpu")


def _compress(x: torch.Tensor, layout: ActivationLayout):
    return compress_triton.compress(x, layout, torch.zeros(1, dtype=torch.int32), block=32, segment_blocks=2)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for case in CONV_CASES:
        check_conv(case, _compress, lambda a, w, i: conv_triton.conv(a, w, i, block_a=64, block_w=32), CPU)
    for case in GEMM_CASES[-4:]:  # the epilogue kernel (the product is torch's), 1×1 paths included
        check_conv_gemm(case, CPU, residual=case.stride == 1, relu=case.kernel != 1)
    for wd, ad in ((0.3, 0.5), (1.0, 1.0), (0.0, 0.5), (0.5, 0.0)):
        check_linear(97, 33, wd, ad, _compress, linear_triton.linear, CPU)
        check_linear_rows(97, 33, wd, ad, relu=wd != 1.0, device=CPU)

    x = torch.rand(2, 6, 6) + 0.1
    layout = ActivationLayout(2, (6, 6), (1, 1), (0, 0), 10)
    flag = torch.zeros(1, dtype=torch.int32)
    acts = compress_triton.compress(x, layout, flag, block=16)
    assert flag.item() == 1 and acts.counts.tolist() == [36, 36]
    assert_same_compression(acts, compress_reference.compress(x, layout))

    torch.manual_seed(0)
    for model, densities, size in ((vgg_like(width=4), 0.4, 16), (ResNetLike(Bottleneck, (1, 1), width=4), 0.3, 16)):
        model = randomize_batchnorm(model).eval()
        prune(model, densities)
        net = convert(model, torch.randn(1, 3, size, size)).set_backend("triton")
        x = torch.randn(1, 3, size, size)
        with torch.no_grad():
            assert relative_error(net(x), model(x)) <= REL_TOL
        net.check_overflow()
    half_checks()
    print("interpreted checks passed")


def half_checks() -> None:
    """fp16 and bf16: compression, the Triton conv and FC kernels, the GEMM epilogue, a converted network."""
    conv = lambda a, w, i: conv_triton.conv(a, w, i, block_a=64, block_w=32)  # noqa: E731
    for dtype in HALF_DTYPES:
        for case in (CONV_CASES[1], CONV_CASES[3]):
            check_conv_half(case, _compress, conv, dtype, CPU)
        check_linear_half(53, 21, _compress, linear_triton.linear, dtype, CPU)
        check_linear_rows_half(53, 21, dtype, CPU)
        check_conv_gemm_half(GEMM_CASES[-1], dtype, CPU)
        torch.manual_seed(1)
        model = randomize_batchnorm(ResNetLike(Bottleneck, (1, 1), width=4)).eval()
        prune(model, 0.3)
        model = model.to(dtype)
        x = torch.randn(1, 3, 16, 16).to(dtype)
        net = convert(model, x)
        assert net.backend == "triton" and net.dtype == dtype
        check_network_half(model, x, dtype, net)
        net.check_overflow()


if __name__ == "__main__":
    main()
