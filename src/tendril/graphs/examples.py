"""Example calls for ahead-of-time capture (`GraphedCallable.capture`): the forms accepted and their progress bar."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Call:
    """One example call for ahead-of-time capture: `fast.capture([Call((ids,), {"attention_mask": m}), ...])`."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None


def as_call(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments of one example: a `Call`, a tensor, a dict of keywords, or a tuple."""
    if isinstance(example, Call):
        return tuple(example.args), dict(example.kwargs or {})
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, Sequence):
        return tuple(example), {}
    raise TypeError(
        f"capture example of type {type(example).__name__}: expected a tuple of arguments, a dict of keyword "
        "arguments, a tendril.graphs.Call or a tensor"
    )


def progress_bar(items: list[Any], name: str, show: bool) -> Iterable[Any]:
    """`items`, with a transient progress bar while capturing them when `show`."""
    if not show:
        return items
    from rich.progress import track

    return track(items, description=f"capturing {len(items)} graphs of {name}", transient=True)
