"""What the zero-copy predictor knows about an op: who produced a tensor, its `out=` form, its signature.

A producer is named by the op and how many times it ran since the callable's last call (`ProducerKey`).
An op can be redirected only through an `out=` form (`out_call` for torch functions and tensor methods,
`out_form` for aten overloads inside a capture), and only while its *signature* (argument dtypes, devices
and constants, which fix the output dtype) matches the one learned. `reads_range` tells whether an op may
read the bytes it would write.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ProducerKey:
    """Which op produced a tensor: the torch function (or, inside a capture, the aten overload) and its
    occurrence count since the callable's last call."""

    op: Any
    occurrence: int

    def __str__(self) -> str:
        return f"{op_name(self.op)}#{self.occurrence}"


def op_name(op: Any) -> str:
    """`index_select` for `torch.Tensor.index_select`, `aten.index_select.default` for an aten overload."""
    if isinstance(op, torch._ops.OpOverload):
        return str(op)
    return getattr(op, "__qualname__", None) or repr(op)



@functools.cache
def out_form(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The `out=` overload of a functional op with one tensor output, or None."""
    if len(op._schema.returns) != 1 or op._schema.is_mutable:
        return None
    wanted = [(argument.name, str(argument.type)) for argument in op._schema.arguments]
    for name in op.overloadpacket.overloads():
        candidate = getattr(op.overloadpacket, name)
        outs = [argument for argument in candidate._schema.arguments if argument.is_out]
        inputs = [
            (argument.name, str(argument.type)) for argument in candidate._schema.arguments if not argument.is_out
        ]
        if len(outs) == 1 and outs[0].name == "out" and inputs == wanted:
            return candidate
    return None


def out_call(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """How to run torch function or tensor method `func` with `out=`: the `torch.<name>` binding, or None.

    Only a public builtin `torch.<name>`, called directly or as the tensor method of that name, whose aten
    op has an `out=` overload: aten ops with an `out=` form compute new values (views and in-place ops
    have none), and the binding takes the method's receiver as its first argument. Python functions
    of the same name (`torch.nn.functional.relu`, `torch.split`) are not used; a binding that then
    rejects the arguments raises `TypeError` before anything runs, and the producer is unlinked.
    """
    call = _OUT_CALLS.get(func, _UNKNOWN)
    if call is not _UNKNOWN:
        return call
    name = getattr(func, "__name__", None)
    call = None
    if isinstance(name, str) and not name.startswith("_"):
        binding = getattr(torch, name, None)
        packet = getattr(torch.ops.aten, name, None) if isinstance(binding, types.BuiltinFunctionType) else None
        is_it = func is binding or func is getattr(torch._C.TensorBase, name, None)
        if is_it and isinstance(packet, torch._ops.OpOverloadPacket) and _has_out_overload(packet):
            call = binding
    _OUT_CALLS[func] = call
    return call


def _has_out_overload(packet: torch._ops.OpOverloadPacket) -> bool:
    for name in packet.overloads():
        outs = [argument for argument in getattr(packet, name)._schema.arguments if argument.is_out]
        if len(outs) == 1 and outs[0].name == "out":
            return True
    return False


_OUT_CALLS: dict[Any, Callable[..., Any] | None] = {}
_UNKNOWN: Any = object()


def signature(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What fixes an op's output dtype and device: argument dtypes/devices and non-tensor constants.

    Aten op arguments are tensors, scalars, or lists of them, so one level of nesting is enough (and
    much cheaper than pytree on the per-op path).
    """
    return survey(args, kwargs)[0]


def survey(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], list[int] | None]:
    """`signature(args, kwargs)`, and the data pointers of the tensor arguments when all of them are plain
    tensors at the top level with storage (else None: a list, a keyword, a subclass or a sparse tensor, for
    `reads_range` to walk), in one pass: the per-op path of a linked producer needs both. Plain tensors and
    scalars, the common arguments, are described inline (as `describe` would describe them, without its call)."""
    described: list[Any] = []
    pointers: list[int] | None = []
    for value in args:
        kind = type(value)
        if kind is _Tensor:
            described.append((value.dtype, value.device, value.dim() == 0))
            if pointers is not None:
                try:
                    pointers.append(value.data_ptr())
                except RuntimeError:  # no storage (sparse): `reads_range` refuses it
                    pointers = None
        elif kind in _SCALARS:
            described.append((kind, value))
        else:
            described.append(describe(value))
            pointers = None
    if kwargs:
        described += kwargs
        described += map(describe, kwargs.values())
        pointers = None
    return tuple(described), pointers


def tensor_arguments(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def reads_between(
    pointers: list[int] | None, args: Sequence[Any], kwargs: dict[str, Any], start: int, end: int
) -> bool:
    """`reads_range`, from `survey`'s pointers when it has them."""
    if pointers is None:
        return reads_range(args, kwargs, start, end)
    for pointer in pointers:  # noqa: SIM110 (a loop: `any()` of a generator costs more than the check)
        if start <= pointer < end:
            return True
    return False


def reads_range(args: Sequence[Any], kwargs: dict[str, Any], start: int, end: int) -> bool:
    """Whether a tensor argument (or one in a list argument) may read [start, end): it starts there, or it has
    no data pointer to check (a sparse tensor, whose values could live anywhere). `tensor_arguments`' tensors,
    checked as they are met, without building the list."""
    for value in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(value, _Tensor):
            if _may_read(value, start, end):
                return True
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, _Tensor) and _may_read(item, start, end):
                    return True
    return False


def _may_read(tensor: torch.Tensor, start: int, end: int) -> bool:
    try:
        pointer = tensor.data_ptr()
    except RuntimeError:
        return True
    return start <= pointer < end


def describe(value: Any) -> Any:
    """One argument as `signature` sees it: a tensor's dtype, device and whether it is 0-d; a constant by value."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.device, value.dim() == 0)
    kind = type(value)
    if kind in _SCALARS:
        return (kind, value)  # 1, 1.0 and True are equal but promote differently
    if isinstance(value, (list, tuple)):
        return tuple(map(describe, value))
    try:
        hash(value)
    except TypeError:
        return kind
    return (kind, value)


_SCALARS = frozenset({int, float, bool, complex, str, type(None)})
_Tensor = torch.Tensor
