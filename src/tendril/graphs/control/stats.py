"""What control flow records while it runs: calls per lowering, and the bound flags of predicated loops.

A predicated `while_loop` inside a captured graph cannot raise when it hits `max_iterations` (the graph runs
without the host), so it sets a device flag instead; `check_loop_bounds()` reads the flags after a replay.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch


class LoopBoundExceeded(RuntimeError):
    """A predicated `while_loop` still wanted to iterate after `max_iterations` iterations."""


@dataclass
class ControlFlowStats:
    """How many `cond`/`while_loop` calls ran with each lowering, and why predication was chosen."""

    eager: int = 0
    conditional_node: int = 0
    predication: int = 0
    fallback_reasons: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class LoopBoundCheck:
    """A predicated loop inside a captured graph: `exceeded` is set on the device by each replay."""

    name: str
    max_iterations: int
    exceeded: torch.Tensor


_stats = ControlFlowStats()
_bound_checks: list[LoopBoundCheck] = []


def control_flow_stats() -> ControlFlowStats:
    """A copy of the per-lowering call counts so far."""
    return ControlFlowStats(
        _stats.eager, _stats.conditional_node, _stats.predication, collections.Counter(_stats.fallback_reasons)
    )


def reset_control_flow_stats() -> None:
    """Start the per-lowering call counts from zero."""
    global _stats
    _stats = ControlFlowStats()


def check_loop_bounds() -> None:
    """After replaying graphs with predicated loops: raise `LoopBoundExceeded` if any loop hit its bound.

    Reads one flag per predicated loop captured so far (a host sync); each flag describes the latest
    replay of its graph. `clear_loop_bound_checks()` forgets the loops of graphs no longer used.
    """
    exceeded = [c for c in _bound_checks if bool(c.exceeded)]
    if exceeded:
        names = ", ".join(f"{c.name} (max_iterations={c.max_iterations})" for c in exceeded)
        raise LoopBoundExceeded(
            f"predicated while_loop still running after its bound: {names}; its results are truncated. "
            "Raise max_iterations, or use a driver with CUDA conditional nodes (>= 12.4)."
        )


def clear_loop_bound_checks() -> None:
    """Forget the bound flags of every predicated loop captured so far (their graphs are no longer replayed)."""
    _bound_checks.clear()


def count(how: str, reason: str) -> None:
    """Count one call lowered `how`; a predicated one also counts `reason`, why it was chosen."""
    setattr(_stats, how, getattr(_stats, how) + 1)
    if how == "predication":
        _stats.fallback_reasons[reason] += 1


def record_bound_check(check: LoopBoundCheck) -> None:
    """Remember the bound flag of a predicated loop just captured, for `check_loop_bounds`."""
    _bound_checks.append(check)
