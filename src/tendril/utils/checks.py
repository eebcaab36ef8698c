"""Argument checks shared by the public entry points."""

from __future__ import annotations

import numbers


def is_integer(value: object) -> bool:
    """Whether `value` is an integer, numpy's included, and not a bool: `True` passed for a count or a size is a
    mistake, not 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
