"""Argument checks shared by `cond` and `while_loop`: tensor structure, predicates, unchanged shapes, no mutation.

Control-flow functions take and return tensors only; results keep the carried shapes, dtypes and devices;
functions must not modify their arguments in place (version counters tell); and results never alias the
caller's tensors, so a caller can keep its inputs and its outputs apart.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Structure:
    """A function's tensor result, flattened: one tensor, or a tuple of them."""

    tensors: list[torch.Tensor]
    single: bool

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        return tensors[0] if self.single else tuple(tensors)


def flatten(value: Any, what: str) -> Structure:
    if isinstance(value, torch.Tensor):
        return Structure([value], single=True)
    if isinstance(value, (tuple, list)):
        return Structure(as_tensors(value, what, allow_empty=True), single=False)
    raise TypeError(f"{what}: expected a tensor or a tuple of tensors, got {type(value).__name__}")


def as_tensors(values: Any, what: str, allow_empty: bool = False) -> list[torch.Tensor]:
    if isinstance(values, torch.Tensor):
        values = (values,)
    if not isinstance(values, (tuple, list)):
        raise TypeError(f"{what}: expected a tuple of tensors, got {type(values).__name__}")
    if not values and not allow_empty:
        raise ValueError(f"{what}: expected at least one tensor")
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                f"{what}[{i}] is a {type(v).__name__}; control flow carries tensors only "
                f"(wrap it: torch.tensor(value, device=...))"
            )
    return list(values)


def as_pred(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.numel() != 1:
        got = f"{value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise TypeError(f"{what}: expected a one-element bool tensor (e.g. `(x.sum() > 0)`), got {got}")
    return value


def match_layout(values: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], what: str, ref_what: str) -> None:
    if len(values) != len(reference):
        raise ValueError(f"{what}: expected {len(reference)} tensors (like the {ref_what}), got {len(values)}")
    for i, (v, r) in enumerate(zip(values, reference, strict=True)):
        if v.shape != r.shape or v.dtype != r.dtype or v.device != r.device:
            raise ValueError(
                f"{what} {i} is {_describe(v)} but {ref_what} {i} is {_describe(r)}: shapes, dtypes and devices must "
                "not change (pad to a fixed size and carry the real length as a tensor)"
            )


def _describe(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def checked_call(fn: Callable[..., Any], ops: list[torch.Tensor], what: str) -> Structure:
    with unmodified(ops, f"{what} {fn_name(fn)!r}"):
        result = fn(*ops)
    return flatten(result, f"{what} {fn_name(fn)!r} result")


@contextlib.contextmanager
def unmodified(tensors: Sequence[torch.Tensor], what: str) -> Iterator[None]:
    """Raise if the block modifies any of `tensors` in place (their version counters change).

    Inference tensors have no version counter and are not checked.
    """
    tracked = [t for t in tensors if not t.is_inference()]
    versions = [t._version for t in tracked]
    yield
    for i, (t, before) in enumerate(zip(tracked, versions, strict=True)):
        if t._version != before:
            raise ValueError(
                f"{what} modified its argument {i} in place; return a new tensor instead "
                "(control-flow functions must not mutate their inputs)"
            )


def fresh(structure: Structure, inputs: Sequence[torch.Tensor]) -> Any:
    return structure.rebuild(fresh_tensors(structure.tensors, inputs))


def fresh_tensors(values: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Results never alias the caller's tensors: copy any result that is one of them."""
    return [v.clone() if any(v is i for i in inputs) else v for v in values]


def fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
