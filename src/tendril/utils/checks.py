"""Argument checks shared by the public entry points."""

from __future__ import annotations

import math
import numbers


def is_integer(value: object) -> bool:
    """Whether `value` is an integer, numpy's included, and not a bool: `True` passed for a count or a size is a
    mistake, not 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """Whether `value` is a finite real number (numpy's included), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
