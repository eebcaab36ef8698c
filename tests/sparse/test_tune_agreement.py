"""`SparseNetwork.tune` admits the register-tiled kernel only when its layer output agrees with the shared-memory
kernel's: the agreement check on the CPU, with a step whose kernels are stubs."""

from __future__ import annotations

import pytest
import torch

from tendril.sparse.network import AGREEMENT_RTOL, SparseNetwork


class StubStep:
    """A conv step whose "cuda" kernel gives `expected` and whose "register" kernel gives `register(expected)`."""

    def __init__(self, register) -> None:
        self.conv_kernel = "cuda"
        self.expected = torch.randn(8, 5, 5)
        self.register = register

    def run(self, inputs, state):
        if self.conv_kernel == "cuda":
            return self.expected.clone()
        return self.register(self.expected)


def _rejection(register):
    network = SparseNetwork([], "x", "y", torch.device("cpu"))
    return network._register_rejection(StubStep(register), [torch.zeros(1)])


def test_an_agreeing_kernel_is_admitted():
    assert _rejection(lambda y: y * (1 + AGREEMENT_RTOL / 10)) is None


@pytest.mark.parametrize(
    ("register", "reason"),
    [
        (lambda y: y * (1 + AGREEMENT_RTOL * 10), "relative error 1.00e-04"),
        (lambda y: torch.full_like(y, float("nan")), "relative error nan"),
        (lambda y: y.flip(0), "relative error"),
    ],
)
def test_a_disagreeing_kernel_is_rejected_with_its_error(register, reason):
    assert reason in _rejection(register)


def test_a_kernel_that_cannot_run_is_rejected_with_the_exception():
    def broken(y):
        raise RuntimeError("NVRTC: unsupported option")

    assert _rejection(broken) == "RuntimeError: NVRTC: unsupported option"
