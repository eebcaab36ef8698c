"""The `TorchFunctionMode` that routes a `zero_copy()` block's torch calls through the predictor.

A function mode sees the program's calls only, not the aten ops underneath them, which keeps the per-op
cost low (a `TorchDispatchMode` would see, and pay for, every aten op). While a call of the callable runs,
the mode is lifted off torch's mode stack (`lift_mode`), so the call's own tensor handling costs nothing
extra. Host time is hidden while the GPU is the bottleneck, as in a decode loop that does not synchronise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from tendril.graphs.zero_copy.predictor import ZeroCopyPredictor


class ZeroCopyMode(TorchFunctionMode):
    """Routes every torch call between calls of the callable through a `ZeroCopyPredictor`."""

    def __init__(self, predictor: ZeroCopyPredictor) -> None:
        super().__init__()
        self.predictor = predictor

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        return self.predictor.dispatch(func, args, kwargs or {})


def lift_mode(predictor: ZeroCopyPredictor) -> ZeroCopyMode | None:
    """Take `predictor`'s mode off torch's function-mode stack if it is on top (else None): a call of the
    callable then runs without the mode's per-call cost. `restore_mode` puts it back."""
    depth = torch._C._len_torch_function_stack()
    if depth == 0:
        return None
    top = torch._C._get_function_stack_at(depth - 1)
    if not isinstance(top, ZeroCopyMode) or top.predictor is not predictor:
        return None
    return torch._C._pop_torch_function_stack()


def restore_mode(mode: ZeroCopyMode | None) -> None:
    if mode is not None:
        torch._C._push_on_torch_function_stack(mode)
