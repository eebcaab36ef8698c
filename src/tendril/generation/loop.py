"""The decode loop as `while_loop(cond_fn, body_fn, carried)`.

Generation is written against this one signature (`cond_fn(*carried) -> 0-d bool tensor`,
`body_fn(*carried) -> new carried tuple of the same shapes and dtypes`) so that it runs unchanged as
one device-side WHILE graph (`tendril.graphs.control.while_loop`) or eagerly. `while_loop()` returns
the graphed implementation when that module provides it, else the eager reference below, and
`loop_backend()` says which one runs and why (no silent fallback).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

Cond = Callable[..., torch.Tensor]
Body = Callable[..., tuple[torch.Tensor, ...]]
WhileLoop = Callable[[Cond, Body, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]]


def eager_while_loop(cond_fn: Cond, body_fn: Body, carried: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Reference semantics: one host sync per iteration to read the condition."""
    carried = tuple(carried)
    while bool(cond_fn(*carried)):
        new = tuple(body_fn(*carried))
        if len(new) != len(carried) or any(
            a.shape != b.shape or a.dtype != b.dtype for a, b in zip(new, carried, strict=True)
        ):
            raise ValueError("while_loop body must return tensors of the carried shapes and dtypes")
        carried = new
    return carried


def _graphed() -> tuple[WhileLoop | None, str]:
    try:
        control = importlib.import_module("tendril.graphs.control")
    except ImportError:
        return None, "tendril.graphs.control is not available"
    loop = getattr(control, "while_loop", None)
    if loop is None:
        return None, "tendril.graphs.control has no while_loop"
    return loop, "tendril.graphs.control.while_loop"


def while_loop() -> WhileLoop:
    """The loop implementation generation uses (see `loop_backend`)."""
    loop, _ = _graphed()
    return loop if loop is not None else eager_while_loop


def loop_backend() -> str:
    """Which loop runs, e.g. 'tendril.graphs.control.while_loop' or 'eager (tendril.graphs.control ...)'."""
    loop, reason = _graphed()
    return reason if loop is not None else f"eager ({reason})"
