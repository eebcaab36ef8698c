"""The `"ell"` Triton kernel compiled for sm_90 on the CPU (`tests/generation/hopper_compile.py`): type errors of the
compiled language that the interpreter never checks, for both reading modes and every run length of `CONFIGS`."""

from __future__ import annotations

import pytest
import torch

from tendril import config
from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.ops.conv.ell import kernel as ell_kernel
from tendril.sparse.ops.conv.ell.dataflow import CONFIGS
from tendril.sparse.ops.conv.ell.packing import pack
from tests.generation.hopper_compile import hopper_compile

RUNS = sorted({c.run for c in CONFIGS})


@pytest.mark.parametrize("kernel_hw", [(3, 3), (1, 1)], ids=["shifted", "pointwise"])
@pytest.mark.parametrize("run", RUNS)
def test_the_kernel_compiles_for_hopper(kernel_hw, run, monkeypatch):
    monkeypatch.setattr(config, "settings", config.Config(triton_interpret=True))  # launch, not emulate, on CPU
    pad = kernel_hw[0] // 2
    geometry = ConvGeometry(16, 16, kernel_hw, (1, 1), (pad, pad), 1, (12, 12))
    weight = torch.randn(16, 16, *kernel_hw) * (torch.rand(16, 16, *kernel_hw) < 0.3)
    packed = pack(SparseConvWeights.from_dense(weight.half(), geometry), next(c for c in CONFIGS if c.run == run))
    x = torch.randn(1, 16, 12, 12).half()
    assert hopper_compile(ell_kernel._ell_conv_kernel, lambda: ell_kernel.conv(x, packed, torch.zeros(16))) == 1
