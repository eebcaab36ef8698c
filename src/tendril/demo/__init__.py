"""`tendril demo`: side-by-side runs of what tendril does against what users do today.

Each section module in this package defines `SECTION`, a `DemoSection`; `sections()` finds them all,
so a feature adds its demo by adding one module (`models.py`, with no section, holds what sections
share). A section runs for real on the device it is given (no canned numbers) and, without a GPU,
runs its CPU paths and says plainly what needs a GPU.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Row:
    """One variant of a side-by-side comparison; `baseline` marks the row speedups are relative to."""

    variant: str
    detail: str
    ms: float | None
    baseline: bool = False
    check: str = ""
    """What was verified for this row (e.g. `max |err| 2e-7 vs eager`)."""


@dataclass(frozen=True)
class SectionResult:
    title: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)

    def speedup(self, row: Row) -> float | None:
        base = next((r for r in self.rows if r.baseline), None)
        if base is None or base.ms is None or row.ms is None or row.ms <= 0:
            return None
        return base.ms / row.ms


@dataclass(frozen=True)
class DemoSection:
    order: int
    title: str
    run: Callable[[torch.device, bool], SectionResult]
    """Called with the device to run on and `quick` (fewer repetitions, for tests)."""


def sections() -> list[DemoSection]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        section = getattr(module, "SECTION", None)
        if isinstance(section, DemoSection):
            found.append(section)
    return sorted(found, key=lambda s: s.order)
