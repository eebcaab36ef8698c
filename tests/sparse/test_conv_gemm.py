"""The GEMM convolution (`tendril.sparse.ops.conv.gemm`) on the CPU: its im2col paths and epilogue against F.conv2d."""

import pytest
import torch

from tendril.sparse.format import ConvGeometry
from tendril.sparse.ops.conv.gemm import kernel as conv_gemm
from tests.sparse.checks import GEMM_CASES, check_conv_gemm

CPU = torch.device("cpu")


@pytest.mark.parametrize("case", GEMM_CASES, ids=str)
@pytest.mark.parametrize(("residual", "relu"), [(False, False), (False, True), (True, True)])
def test_gemm_convolution_matches_dense(case, residual, relu):
    check_conv_gemm(case, CPU, residual=residual, relu=relu)


def test_a_pointwise_convolution_reads_its_input_without_a_copy():
    g = ConvGeometry(8, 4, (1, 1), (1, 1), (0, 0), 1, (5, 6))
    x = torch.randn(1, 8, 5, 6)
    assert conv_gemm.columns(x, g).data_ptr() == x.data_ptr()
    strided = ConvGeometry(8, 4, (1, 1), (2, 2), (0, 0), 1, (5, 6))
    assert conv_gemm.columns(x, strided).shape == (1, 8, 9)


def test_grouped_convolutions_and_malformed_epilogues_are_refused():
    grouped = ConvGeometry(4, 4, (3, 3), (1, 1), (1, 1), 2, (5, 5))
    assert not conv_gemm.supports(grouped)
    with pytest.raises(ValueError, match="groups=2"):
        conv_gemm.conv(torch.randn(1, 4, 5, 5), torch.randn(4, 2, 3, 3), torch.zeros(4), grouped)
    with pytest.raises(ValueError, match="bias"):
        conv_gemm.epilogue_(torch.zeros(1, 3, 4), torch.zeros(4), None, relu=False)
    with pytest.raises(ValueError, match="residual"):
        conv_gemm.epilogue_(torch.zeros(1, 3, 4), torch.zeros(3), torch.zeros(5), relu=False)
