"""The fused decode kernels on the CPU through Triton's interpreter; run by test_kernels.py in a subprocess
with TRITON_INTERPRET=1 (the variable must be set before the kernels are defined)."""

from __future__ import annotations

import torch

from tendril.config import settings
from tendril.generation.kernels import attention
from tests.generation.kernel_cases import (
    check_argmax,
    check_attention,
    check_attention_through_rows,
    check_greedy_choice,
    check_linear,
)


def main() -> None:
    assert settings.triton_interpret and attention.INTERPRETED, "run with TRITON_INTERPRET=1"
    # the interpreter takes ~0.1 s a launch: a lean set here, the full one on the GPU (test_kernels_gpu.py);
    # the architectures' fused forwards are checked on the CPU through the references (test_kernels.py)
    assert check_linear(torch.float32, "cpu", rows=2, launches=((16, 16, 3),)) > 0  # split K, last share shorter
    assert check_linear(torch.float32, "cpu", rows=5, launches=((32, 64, 1),)) > 0  # two row groups, one a row
    assert check_linear(torch.float16, "cpu", rows=1, launches=((None, None, None),)) > 0
    # bf16: Llama's projections (RMSNorm + gated SiLU; RMSNorm + three; with a residual)
    assert check_linear(torch.bfloat16, "cpu", rows=1, launches=((None, None, None),), picked=(3, 4, 6)) > 0
    for dtype in (torch.float32, torch.float16):
        assert check_attention(dtype, "cpu") > 0  # the GPU test's cases, cache writes compared exactly
    assert check_attention(torch.bfloat16, "cpu", slots=(20,), exact_cache=False) > 0  # see check_attention
    assert check_attention_through_rows(torch.float32, "cpu", slots=(5, 20)) > 0  # beam search's row table
    assert check_argmax("cpu") > 0
    assert check_greedy_choice("cpu") > 0
    print("interpreted checks passed")


if __name__ == "__main__":
    main()
