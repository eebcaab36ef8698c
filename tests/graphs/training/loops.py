"""Shared by the CPU and GPU tests of graphed training steps: a small model, step functions, an eager reference
loop and exact / relative comparisons of parameters and optimizer state."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.hf_training_steps import backward_and_update, rel_diffs, state_of
from tendril.graphs.buckets import Buckets, Pad

__all__ = ["state_of"]


def assert_within(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tolerance: float, context: Any = None
) -> None:
    """Every named tensor of `a` within `tolerance` of `b`'s relative to its largest value; names the worst three
    (and `context`, if given)."""
    diffs = rel_diffs(a, b)
    worst = dict(list(diffs.items())[:3])
    assert max(diffs.values(), default=0.0) <= tolerance, worst if context is None else (worst, context)


SEQ_BUCKETS = Buckets((4, 8), (("x", Pad(dim=1, value=0.0)), ("y", Pad(dim=1, value=0.0))), cut_outputs=False)
"""Pads the sequence dimension of both the inputs and the targets (zeros: the loss below sums, so a padded position
adds (f(0) - 0)^2, the same in the eager reference, which runs on the same padded batches)."""


class TokenMLP(nn.Module):
    """A per-position MLP over `[batch, length, width]` with dropout (p=0 for exact comparisons)."""

    def __init__(self, width: int = 8, hidden: int = 16, dropout: float = 0.0) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(width, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def twins(make: Callable[[], nn.Module], device: str | torch.device = "cpu") -> tuple[nn.Module, nn.Module]:
    """Two identical models (same initial weights)."""
    torch.manual_seed(0)
    model = make().to(device)
    return model, copy.deepcopy(model)


def full_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any = None) -> Callable[..., torch.Tensor]:
    """forward + loss + backward + optimizer step + zero_grad(set_to_none=False), returning the loss."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = (model(x) - y).square().sum() / x.shape[0]
        backward_and_update(loss, optimizer, scaler)
        return loss.detach()

    return step


def micro_step(model: nn.Module, parts: int) -> Callable[..., torch.Tensor]:
    """forward + loss / parts + backward only (gradient accumulation)."""

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = (model(x) - y).square().sum() / x.shape[0] / parts
        loss.backward()
        return loss.detach()

    return step


def batches(lengths: list[int], device: str | torch.device = "cpu", batch: int = 2, width: int = 8) -> list[tuple]:
    generator = torch.Generator().manual_seed(1)
    out = []
    for n in lengths:
        x = torch.randn(batch, n, width, generator=generator)
        y = torch.randn(batch, n, width, generator=generator)
        out.append((x.to(device), y.to(device)))
    return out


def padded(data: list[tuple], buckets: Buckets | None, names: tuple[str, ...] = ("x", "y")) -> list[tuple]:
    """The batches as the graphed step runs them (padded to their bucket): what the eager reference runs too.
    `names` are the step's parameter names, in order; every argument the buckets pad must be among them (else the
    reference would silently run unpadded batches)."""
    if buckets is None:
        return data
    missing = [name for name, _ in buckets.pads if name not in names]
    if missing:
        raise ValueError(f"the buckets pad {missing}, not parameters of the step {names}")
    positions = {name: index for index, name in enumerate(names)}
    result = []
    for batch in data:
        call = buckets.pad(batch, {}, positions)
        result.append(tuple(call.args) if call is not None else batch)
    return result


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for name in a:
        assert torch.equal(a[name], b[name]), name
