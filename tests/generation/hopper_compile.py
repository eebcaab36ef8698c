"""Compile a Triton kernel launch for sm_90 without a GPU, to catch what the interpreter never checks.

Triton's interpreter runs kernel bodies as NumPy code, so type errors of the compiled language (a loop-carried
variable changing shape, a constexpr branch that does not type-check) only show on a GPU. `hopper_compile`
intercepts the launches a wrapper makes (its kernel's `run`) and compiles each for an H100/H200 target with
Triton's own compiler, down to a cubin: the same code generation a GPU run does, on the CPU. Arguments are
specialized as Triton's launcher does (`_specialized`): an integer equal to 1 becomes a constant, and tensors and
integers divisible by 16 are marked so. Without that a unit stride is unknown to the compiler, which then loads
contiguous weights one element at a time, and the registers counted are not those of a GPU run. Each cubin's
resource usage (Triton's bundled `cuobjdump`) must show no local memory and no stack frame: a launch configuration
whose registers spill would run far slower than its neighbours, and nothing else on the CPU would notice.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Callable
from typing import Any

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
           torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}
_OPTIONS = ("num_warps", "num_stages", "launch_pdl", "enable_fp_fusion")


def _type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _specialized(value: Any) -> str | None:
    """Triton's launcher's view of an argument: "one" (made a constant), "aligned" (divisible by 16) or None."""
    if isinstance(value, torch.Tensor):
        return "aligned" if value.data_ptr() % 16 == 0 else None
    if isinstance(value, int) and not isinstance(value, bool):
        return "one" if value == 1 else "aligned" if value % 16 == 0 else None
    return None


def hopper_compile(kernel: triton.runtime.JITFunction, launch: Callable[[], Any]) -> int:
    """Run `launch()` (which must launch `kernel`, on any device) with the launch replaced by an sm_90
    compilation of it; returns how many launches were compiled."""
    compiled = []

    def compile_launch(*args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        names = [p.name for p in kernel.params]
        bound = dict(zip(names, args, strict=False))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        constexprs = {name: bound[name] for name, p in zip(names, kernel.params, strict=True)
                      if p.is_constexpr or _specialized(bound[name]) == "one"}
        signature = {name: "constexpr" if name in constexprs else _type(bound[name]) for name in names}
        attrs = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(names)
                 if name not in constexprs and _specialized(bound[name]) == "aligned"}
        options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled.append(triton.compile(source, target=HOPPER, options=options))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernel, "run", compile_launch)
        launch()
    assert all("cubin" in c.asm for c in compiled)
    for c in compiled:
        usage = resource_usage(c.asm["cubin"])
        assert usage["LOCAL"] == 0 and usage["STACK"] == 0, f"{kernel.__name__} spills: {usage}"
    return len(compiled)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, shared and local memory (bytes) of a cubin's kernel, from `cuobjdump --dump-resource-usage`."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run([tool, "--dump-resource-usage", file.name], capture_output=True, text=True, check=True)
    line = next(line for line in report.stdout.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(REG|SHARED|LOCAL|STACK):(\d+)", line)}
