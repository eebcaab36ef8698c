"""Checks of the persistent projection chain (`kernels/chain.py`), shared by the interpreter run on the CPU
(interpreted_kernels.py, one program) and the GPU tests (a program per SM)."""

from __future__ import annotations

import torch

from tendril.generation.kernels.chain import ProjectionChain, reference_chain

SHAPES = [(40, 24), (33, 40), (700, 33), (9, 520), (17, 9)]
"""[out, in] of each phase: partial column blocks, a phase wider than one tile deep, one narrower than a block."""


def check_chain(device: str, programs: int | None = None, dtypes=(torch.float32, torch.float16)) -> int:
    """Every phase's result against `reference_chain` on fresh random weights, twice in a row (the counters start
    from zero at every run), with the activation buffer poisoned with NaN first; returns the checks made."""
    checks = 0
    for dtype in dtypes:
        generator = torch.Generator().manual_seed(0)
        weights = [(torch.randn(out, inp, generator=generator) / inp**0.5).to(device, dtype) for out, inp in SHAPES]
        chain = ProjectionChain(weights)
        for _ in range(2):
            x = torch.randn(SHAPES[0][1], generator=generator).to(device, dtype)
            chain.acts.fill_(float("nan"))
            got = chain.run(x, programs)
            expected = reference_chain(weights, x)
            assert not got.isnan().any(), "an output the chain did not write"
            tolerance = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 6e-2}[dtype]
            torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)
            checks += 1
    return checks
