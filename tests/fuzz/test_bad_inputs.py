"""Bad inputs (see `tests.fuzz.bad_inputs`): a clear exception or the eager result, and everything keeps working.

CPU cases run through `NullBackend` in CI; CUDA cases (out of memory during capture among them) run with
`pytest -m gpu tests/fuzz`.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.fuzz.bad_inputs import BadCase, graphed_cases, run_bad_case
from tests.fuzz.bad_library_inputs import library_cases

CASES = [*graphed_cases(), *library_cases()]


def _params(device: str) -> list[Any]:
    marks = [pytest.mark.gpu] if device == "cuda" else []
    return [pytest.param(case, id=f"{device}-{case.name}", marks=marks) for case in CASES if device in case.devices]


def _check(case: BadCase, device: str) -> None:
    outcome = run_bad_case(case, device)
    assert outcome.status == "ok", outcome.message()


@pytest.mark.parametrize("case", _params("cpu"))
def test_bad_input_on_the_cpu(case: BadCase) -> None:
    _check(case, "cpu")


@pytest.mark.parametrize("case", _params("cuda"))
def test_bad_input_on_cuda(case: BadCase) -> None:
    _check(case, "cuda")


def test_there_are_at_least_a_hundred_bad_inputs_per_device() -> None:
    assert len(_params("cpu")) >= 100
    assert len(_params("cuda")) >= 100
