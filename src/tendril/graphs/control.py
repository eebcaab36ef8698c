"""Data-dependent control flow that stays on the device: `cond` and `while_loop`.

Semantics follow PyTorch's higher-order ops (`torch.cond`, `torch._higher_order_ops.while_loop`):
the predicate is a one-element bool tensor; loop state is a tuple of tensors whose shapes, dtypes
and devices never change; functions must not modify their tensor arguments in place (checked with
version counters); results are new tensors, never the caller's inputs. A loop may run zero times, and
`cond`/`while_loop` nest freely.

How a call runs (its *lowering*) depends on where it is called:

| where                                   | lowering            | what runs                                   |
|-----------------------------------------|---------------------|---------------------------------------------|
| not capturing (CPU, or CUDA eagerly)    | eager               | Python control flow; the predicate is read  |
| capturing, conditional nodes available  | conditional node    | a CUDA IF/WHILE node; no host involvement   |
| capturing, no conditional nodes         | predication         | bounded unrolling under device predicates   |
| `lowering="predication"`, anywhere      | predication         | the same predicated program                 |

Conditional nodes need a driver for CUDA 12.4 (IF/ELSE: 12.8). Predication evaluates the body
`max_iterations` times and keeps each result only while the loop is still running (`torch.where`),
so the body must be safe to evaluate on a state where the loop has already stopped. If the loop
still wanted to run after `max_iterations`, a device flag is set; `check_loop_bounds()` reads the
flags after a replay and raises `LoopBoundExceeded` naming the loop. (Eagerly, it raises at once.)

Every call is counted by lowering in `control_flow_stats()`, with the reason for each automatic
fallback to predication.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from tendril.cuda import runtime
from tendril.graphs import control_capture
from tendril.graphs.control_capture import HostSyncInGraphError

__all__ = [
    "ControlFlowStats",
    "HostSyncInGraphError",
    "LoopBoundCheck",
    "LoopBoundExceeded",
    "check_loop_bounds",
    "clear_loop_bound_checks",
    "cond",
    "control_flow_stats",
    "reset_control_flow_stats",
    "while_loop",
]

Lowering = Literal["auto", "predication"]
IF_ELSE_MIN_DRIVER = 12080
"""IF nodes with an else branch (two body graphs) need a 12.8 driver."""


class LoopBoundExceeded(RuntimeError):
    """A predicated `while_loop` still wanted to iterate after `max_iterations` iterations."""


@dataclass
class ControlFlowStats:
    """How many `cond`/`while_loop` calls ran with each lowering, and why predication was chosen."""

    eager: int = 0
    conditional_node: int = 0
    predication: int = 0
    fallback_reasons: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class LoopBoundCheck:
    """A predicated loop inside a captured graph: `exceeded` is set on the device by each replay."""

    name: str
    max_iterations: int
    exceeded: torch.Tensor


_stats = ControlFlowStats()
_bound_checks: list[LoopBoundCheck] = []


def control_flow_stats() -> ControlFlowStats:
    """A copy of the per-lowering call counts so far."""
    return ControlFlowStats(
        _stats.eager, _stats.conditional_node, _stats.predication, collections.Counter(_stats.fallback_reasons)
    )


def reset_control_flow_stats() -> None:
    global _stats
    _stats = ControlFlowStats()


def check_loop_bounds() -> None:
    """After replaying graphs with predicated loops: raise `LoopBoundExceeded` if any loop hit its bound.

    Reads one flag per predicated loop captured so far (a host sync); each flag describes the latest
    replay of its graph. `clear_loop_bound_checks()` forgets the loops of graphs no longer used.
    """
    exceeded = [c for c in _bound_checks if bool(c.exceeded)]
    if exceeded:
        names = ", ".join(f"{c.name} (max_iterations={c.max_iterations})" for c in exceeded)
        raise LoopBoundExceeded(
            f"predicated while_loop still running after its bound: {names}; its results are truncated. "
            "Raise max_iterations, or use a driver with CUDA conditional nodes (>= 12.4)."
        )


def clear_loop_bound_checks() -> None:
    _bound_checks.clear()


# ---------------------------------------------------------------------------------------------- API


def while_loop(
    cond_fn: Callable[..., torch.Tensor],
    body_fn: Callable[..., Any],
    carried: Sequence[torch.Tensor],
    *,
    max_iterations: int | None = None,
    lowering: Lowering = "auto",
    name: str | None = None,
) -> tuple[torch.Tensor, ...]:
    """`while cond_fn(*state): state = body_fn(*state)`, returning the final state as new tensors.

    `cond_fn(*state)` returns a one-element bool tensor; `body_fn(*state)` returns tensors of the same
    shapes, dtypes and devices as `carried` (a tuple, or one tensor when one is carried).
    `max_iterations` bounds predication (required when it is used) and, eagerly, raises
    `LoopBoundExceeded` when the loop would run longer. `name` labels the loop in errors.
    """
    state = _as_tensors(carried, "while_loop carried")
    if max_iterations is not None and (not isinstance(max_iterations, int) or max_iterations < 0):
        raise ValueError(f"max_iterations must be a non-negative int, got {max_iterations!r}")
    label = name or f"while_loop({_fn_name(cond_fn)}, {_fn_name(body_fn)})"
    how, reason = _choose_lowering(_named("while_loop carried", state), lowering, needs_else=False)
    if how == "predication" and max_iterations is None:
        raise ValueError(f"{label}: predication ({reason}) unrolls the loop and needs a bound: pass max_iterations=N")
    _count(how, reason)
    loop = _Loop(cond_fn, body_fn, label)
    if how == "eager":
        return _while_eager(loop, state, max_iterations)
    if how == "predication":
        assert max_iterations is not None
        with _sync_guard_when_capturing(body_fn, f"{label}: body_fn or cond_fn"):
            return _while_predicated(loop, state, max_iterations)
    return _while_conditional_node(loop, state)


def cond(
    pred: torch.Tensor | bool,
    true_fn: Callable[..., Any],
    false_fn: Callable[..., Any],
    *operands: torch.Tensor,
    lowering: Lowering = "auto",
) -> Any:
    """`true_fn(*operands) if pred else false_fn(*operands)`, deciding on the device when captured.

    Both branches return a tensor, or a tuple of tensors, of the same structure, shapes and dtypes.
    The result is new tensors (a branch may return an operand; it is copied).
    """
    ops = _as_tensors(operands, "cond operands", allow_empty=True)
    if isinstance(pred, bool):
        return _fresh(_flatten(true_fn(*ops) if pred else false_fn(*ops), "cond branch"), ops)
    flag = _as_pred(pred, "cond pred")
    named = [("cond pred", flag), *_named("cond operands", ops)]
    how, reason = _choose_lowering(named, lowering, needs_else=True)
    _count(how, reason)
    if how == "eager":
        chosen = true_fn if bool(flag) else false_fn
        return _fresh(_checked_call(chosen, ops, "cond branch"), ops)
    if how == "predication":
        with _sync_guard_when_capturing(true_fn, "cond true_fn or false_fn"):
            taken = _checked_call(true_fn, ops, "cond true_fn")
            other = _checked_call(false_fn, ops, "cond false_fn")
        _match(other.tensors, taken.tensors, "cond false_fn output", "true_fn output")
        scalar = flag.reshape(())
        return taken.rebuild([torch.where(scalar, t, f) for t, f in zip(taken.tensors, other.tensors, strict=True)])
    return _cond_conditional_node(flag, true_fn, false_fn, ops)


# -------------------------------------------------------------------------------- lowering choice


def _named(what: str, tensors: Sequence[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(f"{what}[{i}]", t) for i, t in enumerate(tensors)]


def _choose_lowering(
    tensors: Sequence[tuple[str, torch.Tensor]], lowering: Lowering, *, needs_else: bool
) -> tuple[str, str]:
    """(lowering, why): "eager", "conditional_node" or "predication"."""
    if lowering not in ("auto", "predication"):
        raise ValueError(f"lowering must be 'auto' or 'predication', got {lowering!r}")
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    if capturing:
        device = torch.device("cuda", torch.cuda.current_device())
        for name, t in tensors:
            if t.device != device:
                raise ValueError(
                    f"{name} is on {t.device}, but a CUDA graph is being captured on {device}; "
                    f"inside a capture every tensor must be on {device} (move it there before capturing)"
                )
    if lowering == "predication":
        return "predication", "lowering='predication' was asked for"
    if not capturing:
        return "eager", "not capturing a CUDA graph"
    support = _conditional_support(needs_else)
    if support.available:
        return "conditional_node", support.reason
    return "predication", f"conditional nodes unavailable: {support.reason}"


@functools.lru_cache(maxsize=2)
def _conditional_support(needs_else: bool) -> runtime.Support:
    support = runtime.conditional_nodes()
    if support.available and needs_else and runtime.driver_version() < IF_ELSE_MIN_DRIVER:
        return runtime.Support(False, "IF/ELSE nodes need a driver for CUDA 12.8")
    return support


def _count(how: str, reason: str) -> None:
    setattr(_stats, how, getattr(_stats, how) + 1)
    if how == "predication":
        _stats.fallback_reasons[reason] += 1


def _sync_guard_when_capturing(fn: Callable[..., Any], what: str) -> contextlib.AbstractContextManager[None]:
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return control_capture.host_sync_guard(fn, what)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------- lowerings


@dataclass(frozen=True)
class _Loop:
    cond_fn: Callable[..., torch.Tensor]
    body_fn: Callable[..., Any]
    label: str

    def test(self, state: Sequence[torch.Tensor]) -> torch.Tensor:
        with _unmodified(state, f"{self.label}: cond_fn"):
            return _as_pred(self.cond_fn(*state), f"{self.label}: cond_fn result")

    def step(self, state: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with _unmodified(state, f"{self.label}: body_fn"):
            new = self.body_fn(*state)
        tensors = _flatten(new, f"{self.label}: body_fn result").tensors
        _match(tensors, state, f"{self.label}: body_fn output", "carried")
        return tensors


def _while_eager(loop: _Loop, state: list[torch.Tensor], max_iterations: int | None) -> tuple[torch.Tensor, ...]:
    carried = list(state)
    iterations = 0
    while bool(loop.test(state)):
        if max_iterations is not None and iterations == max_iterations:
            raise LoopBoundExceeded(f"{loop.label} still running after max_iterations={max_iterations}")
        state = loop.step(state)
        iterations += 1
    return tuple(_fresh_tensors(state, carried))


def _while_predicated(loop: _Loop, state: list[torch.Tensor], max_iterations: int) -> tuple[torch.Tensor, ...]:
    carried = list(state)
    running = loop.test(state).reshape(())
    for _ in range(max_iterations):
        new = loop.step(state)
        state = [torch.where(running, n, s) for n, s in zip(new, state, strict=True)]
        running = running & loop.test(state).reshape(())
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        _bound_checks.append(LoopBoundCheck(loop.label, max_iterations, running))
    elif bool(running):
        raise LoopBoundExceeded(f"{loop.label} still running after max_iterations={max_iterations}")
    return tuple(_fresh_tensors(state, carried))


def _while_conditional_node(loop: _Loop, carried: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    from tendril.cuda.graph_nodes import ConditionalKind, set_condition

    state = [c.clone(memory_format=torch.contiguous_format) for c in carried]
    with control_capture.host_sync_guard(loop.cond_fn, f"{loop.label}: cond_fn"):
        first = loop.test(state)
    splice = control_capture.add_node(first, ConditionalKind.WHILE, branches=1)
    with control_capture.capture_body(splice.bodies[0], loop.body_fn, f"{loop.label}: body_fn or cond_fn"):
        _assign(state, loop.step(state))
        set_condition(splice.handle, loop.test(state))
    return tuple(state)


def _cond_conditional_node(
    flag: torch.Tensor, true_fn: Callable[..., Any], false_fn: Callable[..., Any], ops: list[torch.Tensor]
) -> Any:
    from tendril.cuda.graph_nodes import ConditionalKind

    outer = torch.cuda.current_stream()
    splice = control_capture.add_node(flag, ConditionalKind.IF, branches=2)
    with control_capture.capture_body(splice.bodies[0], true_fn, "cond true_fn"):
        taken = _checked_call(true_fn, ops, "cond true_fn")
        with torch.cuda.stream(outer):  # outputs belong to the caller's graph, at fixed addresses
            outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in taken.tensors]
        for out, t in zip(outputs, taken.tensors, strict=True):
            out.copy_(t)
    with control_capture.capture_body(splice.bodies[1], false_fn, "cond false_fn"):
        other = _checked_call(false_fn, ops, "cond false_fn")
        _match(other.tensors, taken.tensors, "cond false_fn output", "true_fn output")
        for out, t in zip(outputs, other.tensors, strict=True):
            out.copy_(t)
    return taken.rebuild(outputs)


def _assign(state: list[torch.Tensor], new: list[torch.Tensor]) -> None:
    """Copy `new` into the loop's state buffers; values that alias another buffer are copied out first."""
    sources: list[torch.Tensor | None] = []
    for i, value in enumerate(new):
        if value is state[i]:
            sources.append(None)
        elif any(_shares_storage(value, s) for s in state):
            sources.append(value.clone())
        else:
            sources.append(value)
    for buffer, source in zip(state, sources, strict=True):
        if source is not None:
            buffer.copy_(source)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class _Structure:
    """A function's tensor result, flattened: one tensor, or a tuple of them."""

    tensors: list[torch.Tensor]
    single: bool

    def rebuild(self, tensors: list[torch.Tensor]) -> Any:
        return tensors[0] if self.single else tuple(tensors)


def _flatten(value: Any, what: str) -> _Structure:
    if isinstance(value, torch.Tensor):
        return _Structure([value], single=True)
    if isinstance(value, (tuple, list)):
        return _Structure(_as_tensors(value, what, allow_empty=True), single=False)
    raise TypeError(f"{what}: expected a tensor or a tuple of tensors, got {type(value).__name__}")


def _as_tensors(values: Any, what: str, allow_empty: bool = False) -> list[torch.Tensor]:
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


def _as_pred(value: Any, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.numel() != 1:
        got = f"{value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else repr(value)
        raise TypeError(f"{what}: expected a one-element bool tensor (e.g. `(x.sum() > 0)`), got {got}")
    return value


def _match(values: Sequence[torch.Tensor], reference: Sequence[torch.Tensor], what: str, ref_what: str) -> None:
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


def _checked_call(fn: Callable[..., Any], ops: list[torch.Tensor], what: str) -> _Structure:
    with _unmodified(ops, f"{what} {_fn_name(fn)!r}"):
        result = fn(*ops)
    return _flatten(result, f"{what} {_fn_name(fn)!r} result")


@contextlib.contextmanager
def _unmodified(tensors: Sequence[torch.Tensor], what: str) -> Iterator[None]:
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


def _fresh(structure: _Structure, inputs: Sequence[torch.Tensor]) -> Any:
    return structure.rebuild(_fresh_tensors(structure.tensors, inputs))


def _fresh_tensors(values: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Results never alias the caller's tensors: copy any result that is one of them."""
    return [v.clone() if any(v is i for i in inputs) else v for v in values]


def _fn_name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
