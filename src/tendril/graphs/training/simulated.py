"""Capture that records without running, for backends whose capture runs the function (`NullBackend`).

A CUDA capture records the step's kernels without executing them: the parameters, gradients, optimizer state and
random-number generator are as before, and the graphed step replays once to perform the call's step. `NullBackend`
captures by running the function, which for a training step would take an optimizer step too many. `Recording` wraps
such a backend and puts the training state back after its capture (tensor contents and the CPU generator), so the
CPU tests exercise the same rule the CUDA path follows: a step happens exactly once per call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tendril.graphs.backend import Backend, Captured, NullBackend
from tendril.graphs.key import GraphKey
from tendril.graphs.stats import Fallback


def runs_on_capture(backend: Backend) -> bool:
    """Whether `backend.capture` executes the function (so a training step's capture must be undone)."""
    return isinstance(backend, NullBackend)


class Recording:
    """A backend whose capture leaves the training state (`state()`'s tensors, the CPU generator) as it found it."""

    def __init__(self, inner: Backend, state: Callable[[], list[torch.Tensor]]) -> None:
        self.inner = inner
        self._state = state

    def unavailable(self) -> tuple[Fallback, str] | None:
        return self.inner.unavailable()

    def accepts(self, device: torch.device) -> bool:
        return self.inner.accepts(device)

    def pool_bytes(self) -> int:
        return self.inner.pool_bytes()

    def forget_graphs(self) -> None:
        self.inner.forget_graphs()

    def capture(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: GraphKey, warmup: int
    ) -> Captured:
        tensors = self._state()
        with torch.no_grad():
            saved = [tensor.clone() for tensor in tensors]
        generator = torch.get_rng_state()
        try:
            return self.inner.capture(fn, args, kwargs, key, warmup)
        finally:
            with torch.no_grad():
                for tensor, before in zip(tensors, saved, strict=True):
                    tensor.copy_(before)
            torch.set_rng_state(generator)
