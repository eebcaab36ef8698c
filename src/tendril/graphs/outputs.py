"""What a graphed call returns, and the rule for how long it stays valid.

A graph writes its outputs into graph memory, and all graphs of a callable share that memory. So
**the tensors a graphed call returns are valid until the next call of the same callable** (with any
arguments), and while the callable is alive. Keep a result longer by cloning it, or create the
callable with `clone_outputs=True` (one extra copy per output per call).

In debug mode (`TENDRIL_DEBUG=1`, `tendril.settings.debug`) outputs come back as `GraphOutput`
tensors that remember the callable's replay generation; any operation on one after a later replay
overwrote it raises `StaleOutputError` instead of silently reading the newer call's data. Views
and tensors sharing its memory that operations return stay guarded too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree


class StaleOutputError(RuntimeError):
    """A graphed call's output was used after a later call overwrote it."""


class Generation:
    """A counter of replays shared by one callable and its guarded outputs."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


class GraphOutput(torch.Tensor):
    """A tensor in graph memory that raises `StaleOutputError` once a later replay overwrote it (debug mode)."""

    _tendril_generation: Generation
    _tendril_stamp: int
    _tendril_name: str

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        guards = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, GraphOutput)]
        for guard in guards:
            guard._check(func)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if not guards:
            return result
        source = guards[0]
        return pytree.tree_map_only(torch.Tensor, lambda out: _rewrap_if_shared(out, source), result)

    def _check(self, func: Callable[..., Any]) -> None:
        if self._tendril_generation.value != self._tendril_stamp:
            name = getattr(func, "__name__", str(func))
            raise StaleOutputError(
                f"{name} on an output of {self._tendril_name} that a later call overwrote (it was returned by "
                f"call generation {self._tendril_stamp}, the callable is now at {self._tendril_generation.value}). "
                "Graph outputs are valid until the next call: clone what you keep, or use clone_outputs=True."
            )


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _rewrap_if_shared(out: torch.Tensor, source: GraphOutput) -> torch.Tensor:
    with torch._C.DisableTorchFunctionSubclass():
        if isinstance(out, GraphOutput) or not _shares_memory(out, source):
            return out
    return guard(out, source._tendril_generation, source._tendril_name, source._tendril_stamp)


def guard(tensor: torch.Tensor, generation: Generation, name: str, stamp: int | None = None) -> GraphOutput:
    """`tensor` as a `GraphOutput` valid while `generation` stays at its current value (or `stamp`)."""
    with torch._C.DisableTorchFunctionSubclass():
        wrapped = torch.Tensor._make_subclass(GraphOutput, tensor, False)
    wrapped._tendril_generation = generation
    wrapped._tendril_stamp = generation.value if stamp is None else stamp
    wrapped._tendril_name = name
    return wrapped


def guard_outputs(outputs: Any, generation: Generation, name: str) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: guard(t, generation, name), outputs)


def clone_outputs(outputs: Any) -> Any:
    """Copies of every tensor in `outputs`, independent of graph memory."""
    return pytree.tree_map_only(torch.Tensor, torch.clone, outputs)
