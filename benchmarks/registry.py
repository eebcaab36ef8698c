"""The registry of benchmark cases and the `Context` a case reports its measurements through."""

from __future__ import annotations

import importlib
import operator
import pkgutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tendril.utils.timing import Timing

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
    "<": operator.lt,
}


@dataclass(frozen=True)
class Row:
    variant: str
    metric: str
    median: float
    p10: float
    p90: float
    n: int


@dataclass(frozen=True)
class Goal:
    """A target's bound, e.g. `Goal(">=", 5)`."""

    op: str
    bound: float

    def __post_init__(self) -> None:
        if self.op not in _COMPARE:
            raise ValueError(f"goal operator {self.op!r}: expected one of {sorted(_COMPARE)}")

    def met(self, value: float) -> bool:
        return _COMPARE[self.op](value, self.bound)

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


@dataclass
class Context:
    """What a case is given: where to run, how thoroughly, and where its measurements go."""

    device: torch.device
    quick: bool
    rows: list[Row] = field(default_factory=list)
    targets: dict[str, float] = field(default_factory=dict)
    goals: dict[str, Goal] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    """Case-specific structured data (e.g. a per-layer breakdown), written to the JSON as is."""

    def add_timing(self, variant: str, timing: Timing, metric: str = "ms_per_call") -> None:
        self.rows.append(Row(variant, metric, timing.median_ms, timing.p10_ms, timing.p90_ms, timing.n))

    def add_value(self, variant: str, metric: str, value: float) -> None:
        self.rows.append(Row(variant, metric, value, value, value, 1))

    def target(self, name: str, value: float, goal: Goal | None = None) -> None:
        if name in self.targets:
            raise ValueError(f"target {name!r} reported twice")
        self.targets[name] = float(value)
        if goal is not None:
            self.goals[name] = goal

    def note(self, text: str) -> None:
        """Record `text` in the results, and print it at once (a later crash, such as a device-side assert
        that kills the CUDA context, must not take the notes so far with it)."""
        self.notes.append(text)
        print(f"note: {text}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    run: Callable[[Context], None]
    needs_gpu: bool


CASES: dict[str, Case] = {}


def register(name: str, description: str, needs_gpu: bool = True) -> Callable[[Callable[[Context], None]], Any]:
    """Decorator: register `run(ctx)` as the benchmark case `name`."""

    def wrap(run: Callable[[Context], None]) -> Callable[[Context], None]:
        if name in CASES:
            raise ValueError(f"benchmark case {name!r} registered twice")
        CASES[name] = Case(name, description, run, needs_gpu)
        return run

    return wrap


def discover() -> dict[str, Case]:
    """Import every module in `benchmarks.cases`, registering its cases, and return the registry."""
    from benchmarks import cases

    for info in pkgutil.iter_modules(cases.__path__):
        importlib.import_module(f"{cases.__name__}.{info.name}")
    return CASES
