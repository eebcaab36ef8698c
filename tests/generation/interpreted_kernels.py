"""The fused decode kernels on the CPU through Triton's interpreter; run by test_kernels.py in a subprocess
with TRITON_INTERPRET=1 (the variable must be set before the kernels are defined)."""

from __future__ import annotations

import torch
import triton.language as tl
from triton.runtime import interpreter

from tendril.config import settings
from tendril.generation.kernels import attention
from tests.generation.kernel_cases import (
    check_argmax,
    check_attention,
    check_attention_through_rows,
    check_greedy_choice,
    check_linear,
    check_prompt_attention,
    check_step_inputs,
    check_weight_copies,
)
from tests.generation.topk_cases import check_beam_top_k


def _bfloat16_dot_in_float32() -> None:
    """Triton's interpreter stores bfloat16 as uint16 and its `tl.dot` multiplies those bit patterns
    (triton-lang/triton#11584, unsupported upstream): widen bfloat16 operands to float32 first, as exact as the
    GPU's bf16 x bf16 -> float32 products. Other operands pass through unchanged."""
    create_dot = interpreter.InterpreterBuilder.create_dot

    def widened_dot(self, a, b, *rest):
        a, b = (self.cast_impl(t, tl.float32) if t.dtype.scalar == tl.bfloat16 else t for t in (a, b))
        return create_dot(self, a, b, *rest)

    interpreter.InterpreterBuilder.create_dot = widened_dot


def main() -> None:
    assert settings.triton_interpret and attention.INTERPRETED, "run with TRITON_INTERPRET=1"
    # the interpreter takes ~0.1 s a launch: a lean set here, the full one on the GPU (test_kernels_gpu.py);
    # the architectures' fused forwards are checked on the CPU through the references (test_kernels.py)
    assert check_linear(torch.float32, "cpu", rows=2, launches=((16, 16, 3),)) > 0  # split K, last share shorter
    assert check_linear(torch.float32, "cpu", rows=5, launches=((32, 64, 1),)) > 0  # two row groups, one a row
    assert check_linear(torch.float16, "cpu", rows=1, launches=((None, None, None),)) > 0
    # bf16: Llama's projections (RMSNorm + gated SiLU; RMSNorm + three; with a residual)
    assert check_linear(torch.bfloat16, "cpu", rows=1, launches=((None, None, None),), picked=(3, 4, 6)) > 0
    # several half rows: the tensor-core path by default (split K at these sizes), every case, into float32 too;
    # 17 rows: two row blocks of 16, the second of one row
    assert check_linear(torch.float16, "cpu", rows=3, launches=((None, None, None),)) > 0
    assert check_linear(torch.float16, "cpu", rows=17, launches=((None, None, None), (32, 64, 1, True)),
                        picked=(0, 3)) > 0
    assert check_weight_copies(torch.float16, "cpu") > 0
    _bfloat16_dot_in_float32()
    assert check_linear(torch.bfloat16, "cpu", rows=2, launches=((None, None, None),), picked=(3, 4, 6)) > 0
    for dtype in (torch.float32, torch.float16):
        assert check_attention(dtype, "cpu") > 0  # the GPU test's cases, cache writes compared exactly
    assert check_attention(torch.bfloat16, "cpu", slots=(20,), exact_cache=False) > 0  # see check_attention
    assert check_attention_through_rows(torch.float32, "cpu", slots=(5, 20)) > 0  # beam search's row table
    assert check_prompt_attention(torch.float32, "cpu", tokens=(1, 11)) > 0  # one token; several blocks
    assert check_prompt_attention(torch.bfloat16, "cpu", tokens=(11,), exact_cache=False) > 0
    assert check_argmax("cpu") > 0
    assert check_greedy_choice("cpu") > 0
    assert check_beam_top_k("cpu") > 0
    for dtype in (torch.float32, torch.float16):
        assert check_step_inputs(dtype, "cpu") > 0
    # bf16 without learned positions: the interpreter rounds their float32 sum to bf16 toward zero (check_attention)
    assert check_step_inputs(torch.bfloat16, "cpu", learned_positions=False) > 0
    print("interpreted checks passed")


if __name__ == "__main__":
    main()
