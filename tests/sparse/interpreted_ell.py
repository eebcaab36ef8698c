"""The `"ell"` Triton kernel on the CPU under the Triton interpreter; executed by test_ell_conv.py in a
subprocess with TRITON_INTERPRET=1 (the variable must be set before the kernel is defined)."""

from __future__ import annotations

import os

import torch

from tests.sparse.ell_checks import CASES, SMALL_CONFIGS, check_case

CPU = torch.device("cpu")


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    for i, case in enumerate(CASES):  # every config on several cases; bf16 on every other case (time)
        for dtype in (torch.float32, torch.float16, torch.bfloat16)[: 3 if i % 2 == 0 else 2]:
            check_case(case, SMALL_CONFIGS[i % len(SMALL_CONFIGS)], dtype, CPU)
    print("interpreted ell checks passed")


if __name__ == "__main__":
    main()
