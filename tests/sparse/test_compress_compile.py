"""The compression kernels compiled for sm_90 on the CPU (`tests/generation/hopper_compile.py`): type errors of the
compiled language that the interpreter never checks, and no register spills, for both launch plans."""

from __future__ import annotations

import torch

from tendril.sparse.activations import ActivationLayout
from tendril.sparse.ops.compress import triton as compress_triton
from tests.generation.hopper_compile import hopper_compile


def _compress(channels: int, hw: tuple[int, int], stride: int, padding: int, dtype: torch.dtype) -> None:
    layout = ActivationLayout(channels, hw, (stride, stride), (padding, padding), 1).with_capacity(0.5)
    compress_triton.compress(torch.zeros(channels, *hw, dtype=dtype), layout, torch.zeros(1, dtype=torch.int32))


def test_the_single_segment_plan_compiles_for_hopper():
    launch = lambda: _compress(8, (14, 14), 1, 1, torch.float32)  # noqa: E731
    assert hopper_compile(compress_triton._compress_kernel, launch) == 1


def test_the_count_and_compress_plan_compiles_for_hopper():
    """Three segments a plane (102 × 102 phase planes of 4096-position segments): the counts load is padded."""
    compress_launches = []

    def launch() -> None:
        compress = lambda: _compress(3, (200, 200), 2, 3, torch.float16)  # noqa: E731
        compress_launches.append(hopper_compile(compress_triton._compress_kernel, compress))

    assert hopper_compile(compress_triton._count_kernel, launch) == 1
    assert compress_launches == [1]
