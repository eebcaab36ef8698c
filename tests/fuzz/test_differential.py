"""Differential fuzzing: seeded random cases of `tendril.graphed` against eager (see `tests.fuzz.cases`).

On the CPU a subset runs through `NullBackend` in CI; on a GPU (`pytest -m gpu tests/fuzz`) the first
`TENDRIL_FUZZ_GPU_SEEDS` seeds (200 by default, so the GPU suite fits one device call) run on CUDA graphs; the
`reliability` benchmark runs all of `DRAWN_SEEDS`. A failure prints its seed, the case and a one-line reproduction.
"""

from __future__ import annotations

import os

import pytest

from tests.fuzz.cases import draw_case, run_case
from tests.fuzz.models import ALL_MODELS

CPU_SEEDS = range(60)
DRAWN_SEEDS = range(1000)
GPU_SEEDS = range(int(os.environ.get("TENDRIL_FUZZ_GPU_SEEDS", "200")))


def _check(seed: int, device: str) -> None:
    outcome = run_case(draw_case(seed), device)
    if outcome.status == "skipped":
        pytest.skip(outcome.detail)
    assert not outcome.failed, outcome.message()


@pytest.mark.parametrize("seed", CPU_SEEDS, ids=lambda seed: f"cpu_seed_{seed}")
def test_graphed_equals_eager_on_the_null_backend(seed: int) -> None:
    _check(seed, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", GPU_SEEDS, ids=lambda seed: f"cuda_seed_{seed}")
def test_graphed_equals_eager_on_cuda(seed: int) -> None:
    _check(seed, "cuda")


def test_draws_are_reproducible_and_cover_every_option() -> None:
    cases = [draw_case(seed) for seed in DRAWN_SEEDS]
    assert cases[:50] == [draw_case(seed) for seed in range(50)]
    assert {case.model for case in cases} == set(ALL_MODELS)
    assert any(case.buckets for case in cases) and any(case.budget for case in cases)
    assert any(case.zero_copy for case in cases) and any(case.debug for case in cases)
    assert any(len(set(case.lengths)) < len(case.lengths) for case in cases)
    assert any(case.model == "bert" and case.buckets and case.structure.hidden in case.buckets for case in cases)
