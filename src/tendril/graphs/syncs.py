"""`find_host_syncs`: which operations of a function would stop a CUDA graph capture, and where they are.

A capture fails (`Fallback.HOST_SYNC`) at the first operation that needs a tensor's value on the host: a
`.item()`, a `bool()` of a tensor in an `if`, an output whose shape depends on the values (`nonzero`, masked
indexing, `unique`), a copy to the host. The capture error names none of them, and only the first. This runs the
function once, eagerly, and lists every such operation with the first frame outside PyTorch that made it (in a
model's code, the line to change), counted by place.

It watches at two levels: PyTorch's dispatcher (`TorchDispatchMode`), which sees what the tensor kernels do
whatever Python called them, and the tensor methods that read values without a kernel (`TorchFunctionMode`:
`tolist`, `numpy`). So it works on the CPU too, where no capture runs: a value read there is a sync once the
same code runs on CUDA tensors. Copies to the host are reported only from CUDA tensors, since on the CPU nothing
tells which tensors would live on the device.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

VALUE_READ = "reads a tensor's value on the host (.item(), bool(), int(), float(), an index)"
DATA_DEPENDENT_SHAPE = "its output's shape depends on tensor values"
HOST_COPY = "copies a CUDA tensor to the host"

_VALUE_READS = {"aten::_local_scalar_dense", "aten::equal", "aten::is_nonzero"}
_DATA_DEPENDENT = {
    "aten::nonzero", "aten::nonzero_static", "aten::masked_select", "aten::unique_consecutive", "aten::unique_dim",
    "aten::_unique", "aten::_unique2", "aten::repeat_interleave",
}  # fmt: skip
_HOST_READ_METHODS = {"tolist": VALUE_READ, "numpy": VALUE_READ}
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_TORCH_WRAPPERS = tuple(
    os.path.join(_TORCH_DIR, part) for part in ("_dynamo", "_compile.py", os.path.join("utils", "_contextlib.py"))
)
"""Decorators' frames (`torch._dynamo.disable`, `torch.no_grad`...), never the place an operation comes from."""


@dataclass(frozen=True)
class HostSync:
    """One kind of host sync at one place: the operation, why it syncs, where, and how often it ran there.

    `where` is the innermost frame outside PyTorch (the line to change); `via`, the innermost Python frame of
    all, where that is inside PyTorch (an optimizer's or a loss's own code), else the same as `where`."""

    op: str
    reason: str
    where: str
    via: str
    count: int


@dataclass
class HostSyncReport:
    """The host syncs of one run of a function, in the order their places were first met."""

    syncs: list[HostSync] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.syncs)

    def __str__(self) -> str:
        if not self.syncs:
            return "no host syncs"
        lines = [f"{len(self.syncs)} place(s) sync with the host:"]
        lines += [
            f"- {s.where}{'' if s.via == s.where else f' (via {s.via})'}: {s.op} x{s.count} ({s.reason})"
            for s in self.syncs
        ]
        return "\n".join(lines)


def find_host_syncs(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> HostSyncReport:
    """Run `fn(*args, **kwargs)` once and report every operation that would sync with the host inside a CUDA
    graph capture (see the module docstring). Its result is discarded; run it under the grad mode to inspect
    (backward passes and optimizer steps inside `fn` are watched too)."""
    recorder = _Recorder()
    with _FunctionWatch(recorder), _DispatchWatch(recorder):
        fn(*args, **kwargs)
    return recorder.report()


class _Recorder:
    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str, str], int] = {}

    def record(self, op: str, reason: str) -> None:
        key = (op, reason, *_callers())
        self.counts[key] = self.counts.get(key, 0) + 1

    def report(self) -> HostSyncReport:
        return HostSyncReport([HostSync(*key, count) for key, count in self.counts.items()])


class _DispatchWatch(TorchDispatchMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func._schema.name
        reason = _dispatch_reason(name, args, kwargs)
        if reason is not None:
            self.recorder.record(name.removeprefix("aten::"), reason)
        return func(*args, **kwargs)


def _dispatch_reason(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if name in _VALUE_READS:
        return VALUE_READ
    if name in _DATA_DEPENDENT:
        if name == "aten::repeat_interleave" and kwargs.get("output_size") is not None:
            return None
        return DATA_DEPENDENT_SHAPE
    if name == "aten::index" and any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in tree_leaves(args[1:])
    ):
        return DATA_DEPENDENT_SHAPE
    if name in ("aten::_to_copy", "aten::copy_") and _moves_to_host(name, args, kwargs):
        return HOST_COPY
    return None


def _moves_to_host(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if name == "aten::copy_":
        destination, source = args[0], args[1]
        return bool(destination.device.type == "cpu" and source.is_cuda)
    device = kwargs.get("device")
    return bool(args[0].is_cuda and device is not None and torch.device(device).type == "cpu")


class _FunctionWatch(TorchFunctionMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        reason = _HOST_READ_METHODS.get(getattr(func, "__name__", ""))
        if reason is not None:
            self.recorder.record(f"Tensor.{func.__name__}", reason)
        return func(*args, **(kwargs or {}))


def _callers() -> tuple[str, str]:
    """The innermost frame outside PyTorch and this module, and the innermost outside this module, each as
    `file:line in function`."""
    where = via = None
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path == _THIS_FILE or path.startswith(_TORCH_WRAPPERS):
            continue
        place = f"{_short(path)}:{frame.lineno} in {frame.name}"
        via = via or place
        if not path.startswith(_TORCH_DIR):
            where = place
            break
    return where or "<unknown>", via or "<unknown>"


def _short(path: str) -> str:
    """A path from its package root (`transformers/models/...`), or as given outside site-packages."""
    marker = f"{os.sep}site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else os.path.relpath(path)
