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

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tendril.cuda import runtime
from tendril.graphs import capture as graph_capture
from tendril.graphs.control import capture, stats
from tendril.graphs.control.checks import (
    as_pred,
    as_tensors,
    checked_call,
    flatten,
    fn_name,
    fresh,
    fresh_tensors,
    match_layout,
    unmodified,
)
from tendril.graphs.control.stats import LoopBoundCheck, LoopBoundExceeded
from tendril.utils.checks import is_integer

Lowering = Literal["auto", "predication"]
IF_ELSE_MIN_DRIVER = 12080
"""IF nodes with an else branch (two body graphs) need a 12.8 driver."""


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
    state = as_tensors(carried, "while_loop carried")
    if max_iterations is not None and (not is_integer(max_iterations) or max_iterations < 0):
        raise ValueError(f"max_iterations must be a non-negative int, got {max_iterations!r}")
    label = name or f"while_loop({fn_name(cond_fn)}, {fn_name(body_fn)})"
    how, reason = _choose_lowering(_named("while_loop carried", state), lowering, needs_else=False)
    if how == "predication" and max_iterations is None:
        raise ValueError(f"{label}: predication ({reason}) unrolls the loop and needs a bound: pass max_iterations=N")
    stats.count(how, reason)
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
    ops = as_tensors(operands, "cond operands", allow_empty=True)
    if isinstance(pred, bool):
        return fresh(flatten(true_fn(*ops) if pred else false_fn(*ops), "cond branch"), ops)
    flag = as_pred(pred, "cond pred")
    named = [("cond pred", flag), *_named("cond operands", ops)]
    how, reason = _choose_lowering(named, lowering, needs_else=True)
    stats.count(how, reason)
    if how == "eager":
        chosen = true_fn if bool(flag) else false_fn
        return fresh(checked_call(chosen, ops, "cond branch"), ops)
    if how == "predication":
        with _sync_guard_when_capturing(true_fn, "cond true_fn or false_fn"):
            taken = checked_call(true_fn, ops, "cond true_fn")
            other = checked_call(false_fn, ops, "cond false_fn")
        match_layout(other.tensors, taken.tensors, "cond false_fn output", "true_fn output")
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
    capturing = graph_capture.capturing()
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


def _sync_guard_when_capturing(fn: Callable[..., Any], what: str) -> contextlib.AbstractContextManager[None]:
    if graph_capture.capturing():
        return capture.host_sync_guard(fn, what)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------- lowerings


@dataclass(frozen=True)
class _Loop:
    cond_fn: Callable[..., torch.Tensor]
    body_fn: Callable[..., Any]
    label: str

    def test(self, state: Sequence[torch.Tensor]) -> torch.Tensor:
        with unmodified(state, f"{self.label}: cond_fn"):
            return as_pred(self.cond_fn(*state), f"{self.label}: cond_fn result")

    def step(self, state: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        with unmodified(state, f"{self.label}: body_fn"):
            new = self.body_fn(*state)
        tensors = flatten(new, f"{self.label}: body_fn result").tensors
        match_layout(tensors, state, f"{self.label}: body_fn output", "carried")
        return tensors


def _while_eager(loop: _Loop, state: list[torch.Tensor], max_iterations: int | None) -> tuple[torch.Tensor, ...]:
    carried = list(state)
    iterations = 0
    while bool(loop.test(state)):
        if max_iterations is not None and iterations == max_iterations:
            raise LoopBoundExceeded(f"{loop.label} still running after max_iterations={max_iterations}")
        state = loop.step(state)
        iterations += 1
    return tuple(fresh_tensors(state, carried))


def _while_predicated(loop: _Loop, state: list[torch.Tensor], max_iterations: int) -> tuple[torch.Tensor, ...]:
    carried = list(state)
    running = loop.test(state).reshape(())
    for _ in range(max_iterations):
        new = loop.step(state)
        state = [torch.where(running, n, s) for n, s in zip(new, state, strict=True)]
        running = running & loop.test(state).reshape(())
    if graph_capture.capturing():
        stats.record_bound_check(LoopBoundCheck(loop.label, max_iterations, running))
    elif bool(running):
        raise LoopBoundExceeded(f"{loop.label} still running after max_iterations={max_iterations}")
    return tuple(fresh_tensors(state, carried))


def _while_conditional_node(loop: _Loop, carried: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    from tendril.cuda.graph_nodes import ConditionalKind, set_condition

    state = [c.clone(memory_format=torch.contiguous_format) for c in carried]
    with capture.host_sync_guard(loop.cond_fn, f"{loop.label}: cond_fn"):
        first = loop.test(state)
    splice = capture.add_node(first, ConditionalKind.WHILE, branches=1)
    with capture.capture_body(splice.bodies[0], loop.body_fn, f"{loop.label}: body_fn or cond_fn"):
        assign_state(state, loop.step(state))
        set_condition(splice.handle, loop.test(state))
    return tuple(state)


def _cond_conditional_node(
    flag: torch.Tensor, true_fn: Callable[..., Any], false_fn: Callable[..., Any], ops: list[torch.Tensor]
) -> Any:
    from tendril.cuda.graph_nodes import ConditionalKind

    outer = torch.cuda.current_stream()
    splice = capture.add_node(flag, ConditionalKind.IF, branches=2)
    with capture.capture_body(splice.bodies[0], true_fn, "cond true_fn"):
        taken = checked_call(true_fn, ops, "cond true_fn")
        with torch.cuda.stream(outer):  # outputs belong to the caller's graph, at fixed addresses
            outputs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in taken.tensors]
        for out, t in zip(outputs, taken.tensors, strict=True):
            out.copy_(t)
    with capture.capture_body(splice.bodies[1], false_fn, "cond false_fn"):
        other = checked_call(false_fn, ops, "cond false_fn")
        match_layout(other.tensors, taken.tensors, "cond false_fn output", "true_fn output")
        for out, t in zip(outputs, other.tensors, strict=True):
            out.copy_(t)
    return taken.rebuild(outputs)


def assign_state(state: Sequence[torch.Tensor], new: Sequence[torch.Tensor]) -> None:
    """Copy `new` into the loop's state buffers; values that alias another buffer are copied out first (capturable).
    Also what `tendril.generation.decode_step`'s stepper writes its buffers with, so that its step is the loop's body.

    The contiguous pairs go as bytes through one multi-tensor copy (a kernel or two for the whole state, where a
    copy each would be a graph node each: a body's state is often many small tensors); others copy one by one."""
    sources: list[torch.Tensor | None] = []
    for i, value in enumerate(new):
        if value is state[i]:
            sources.append(None)
        elif any(_shares_storage(value, s) for s in state):
            sources.append(value.clone())
        else:
            sources.append(value)
    buffers, values = [], []
    for buffer, source in zip(state, sources, strict=True):
        if source is None or source.numel() == 0:
            continue
        if buffer.is_contiguous() and source.is_contiguous():
            buffers.append(buffer.reshape(-1).view(torch.uint8))
            values.append(source.reshape(-1).view(torch.uint8))
        else:
            buffer.copy_(source)
    if buffers:
        torch._foreach_copy_(buffers, values)


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
