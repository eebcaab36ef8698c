"""Which tensors a graphed callable trains: the parameters and buffers of the modules it runs.

A graph replays kernels; it records no autograd. So a call in grad mode whose result would carry
autograd must run eagerly: when an argument requires grad, or when a parameter or buffer of the
callable does (a module with trainable weights called on plain inputs). The callable's modules are found
once, from what it is:

- an `nn.Module`;
- a bound method of a module (`model.generate`, `model.forward`);
- a function (or `functools.partial`) whose closure, defaults, bound arguments or the globals its code names
  hold modules or bound methods of modules (looked for a few calls deep).

Their tensors are the ones `tendril.graphs.module_state.ModuleState` records, which the callable brings up to date
before every call (replaced tensors included); `requires_grad` is read at every call in grad mode, so
`model.requires_grad_(False)` or `param.requires_grad = False` between calls is seen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils import _pytree as pytree

from tendril.graphs.module_state import ModuleState

_MAX_DEPTH = 4
"""How many closures deep to look for modules (a function calling a function closing over a model)."""


def modules_of(fn: Callable[..., Any]) -> list[torch.nn.Module]:
    """The modules `fn` runs, found from its own object, closure, defaults and bound arguments (no duplicates)."""
    found: dict[int, torch.nn.Module] = {}
    for module in _walk(fn, _MAX_DEPTH, set()):
        found.setdefault(id(module), module)
    return list(found.values())


def _walk(obj: Any, depth: int, seen: set[int]) -> Iterator[torch.nn.Module]:
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        yield obj
        return
    owner = getattr(obj, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        yield owner
        return
    if isinstance(obj, functools.partial):
        for inner in (obj.func, *obj.args, *obj.keywords.values()):
            yield from _walk(inner, depth - 1, seen)
        return
    function = getattr(obj, "__func__", obj)
    cells = getattr(function, "__closure__", None) or ()
    keyword_defaults = getattr(function, "__kwdefaults__", None) or {}
    defaults = (*(getattr(function, "__defaults__", None) or ()), *keyword_defaults.values())
    for value in (*_cell_contents(cells), *defaults, *_named_globals(function)):
        yield from _walk(value, depth - 1, seen)


def _cell_contents(cells: tuple[Any, ...]) -> Iterator[Any]:
    for cell in cells:
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell: a variable not yet assigned
            continue


def _named_globals(function: Any) -> Iterator[Any]:
    code = getattr(function, "__code__", None)
    namespace = getattr(function, "__globals__", None)
    if code is None or namespace is None:
        return
    for name in code.co_names:
        value = namespace.get(name)
        if isinstance(value, torch.nn.Module) or (callable(value) and not isinstance(value, type)):
            yield value


def needs_autograd(args: tuple[Any, ...], kwargs: dict[str, Any], modules: ModuleState) -> str | None:
    """Why this call needs autograd (and so eager execution), or None; checks only under grad mode (see the module
    docstring). `modules`: the state of the callable's modules."""
    if not torch.is_grad_enabled():
        return None
    if any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in pytree.tree_leaves((args, kwargs))):
        return "an argument requires grad"
    if any(tensor.requires_grad for tensor in modules.tensors):
        return "a parameter or buffer of the callable requires grad"
    return None
