"""Whether the modules a graph was captured over still hold the tensors, at the addresses, it reads.

A captured graph reads every parameter and buffer at the address it had during capture. Two kinds of change leave
it reading memory the module no longer uses, which may be freed and reused, so that replays return wrong results
without an error:

- a tensor or submodule is *replaced*: `module.weight = nn.Parameter(...)`, `load_state_dict(..., assign=True)`,
  a submodule swapped for another (adapters, `ModuleList` assignment);
- a tensor's memory *moves*: `.to()`, `.half()`, `.cpu()` then `.cuda()`, `param.data = ...`.

`ModuleTensors` records the tensors of some modules and their addresses. `changed()` says what changed since, for
about the cost of reading each tensor's address: replacements are flagged by PyTorch's global registration hooks
(installed once, they mark the watchers of the module being assigned to), moves by comparing addresses. Writes into
the same memory (in place, `copy_`, through `.data`) are what graphs are for and are not changes. Assignments that
bypass `nn.Module.__setattr__` and `register_*` (writing `module._parameters` directly) are not seen.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module


class GraphWeightsWarning(UserWarning):
    """A graphed callable's module tensors were replaced or moved, so its graphs are captured again."""


_watchers: weakref.WeakSet[ModuleTensors] = weakref.WeakSet()
"""Every live `ModuleTensors`, which the registration hooks mark."""
_hooks_installed = False


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    """PyTorch's global hook for a parameter, buffer or submodule assigned to `module`: flags its watchers."""
    for watcher in list(_watchers):
        if id(module) in watcher.module_ids:
            watcher.assigned = watcher.assigned or f"{type(module).__name__}.{name} was assigned"


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        torch_module.register_module_parameter_registration_hook(_on_registration)
        torch_module.register_module_buffer_registration_hook(_on_registration)
        torch_module.register_module_module_registration_hook(_on_registration)
        _hooks_installed = True


class ModuleTensors:
    """The parameters and buffers of `modules` (with their submodules) and where their memory is (module docstring).

    `tensors` are the current ones as of the last `renew()`; `changed()` reports a replacement or a move since."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = tuple(modules)
        self.module_ids: frozenset[int] = frozenset()
        self.tensors: tuple[torch.Tensor, ...] = ()
        self.assigned: str | None = None
        """Set by the registration hooks: an assignment to one of the modules since `renew` (checked by `changed`)."""
        self._names: tuple[str, ...] = ()
        self._located_names: tuple[str, ...] = ()
        self._located: tuple[torch.Tensor, ...] = ()
        """The tensors whose address can be read (not wrapper subclasses without storage), and their names."""
        self._addresses: list[int] = []
        _install_hooks()
        _watchers.add(self)
        self.renew()

    def renew(self) -> None:
        """Record the modules' tensors and addresses as they are now."""
        self.module_ids, self._names, self.tensors = self._walk()
        located = [(n, t) for n, t in zip(self._names, self.tensors, strict=True) if _has_address(t)]
        self._located_names = tuple(name for name, _ in located)
        self._located = tuple(tensor for _, tensor in located)
        self._addresses = [tensor.data_ptr() for tensor in self._located]
        self.assigned = None

    def changed(self) -> str | None:
        """What changed since the last `renew` (the first tensor replaced, or the first whose memory moved), or None.
        An assignment that put back the same tensors (re-tying weights) is no change."""
        if self.assigned is not None:
            ids, names, tensors = self._walk()
            if names != self._names or any(a is not b for a, b in zip(tensors, self.tensors, strict=True)):
                pairs = zip(names, tensors, self.tensors, strict=False)
                replaced = next((name for name, a, b in pairs if a is not b), "a tensor of the modules")
                return f"{replaced} was replaced ({self.assigned})"
            self.module_ids, self.assigned = ids, None
        addresses = list(map(torch.Tensor.data_ptr, self._located))
        if addresses == self._addresses:
            return None
        moved = next(i for i, (a, b) in enumerate(zip(addresses, self._addresses, strict=True)) if a != b)
        return f"the memory of {self._located_names[moved]} moved"

    def update(self) -> str | None:
        """`changed()`, with the record renewed when something did change."""
        change = self.changed()
        if change is not None:
            self.renew()
        return change

    def _walk(self) -> tuple[frozenset[int], tuple[str, ...], tuple[torch.Tensor, ...]]:
        """The ids of the modules and submodules, and the names and tensors of their parameters and buffers."""
        ids, names, tensors = set(), [], []
        for root in self.modules:
            for prefix, module in root.named_modules(remove_duplicate=False):
                ids.add(id(module))
                for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
                    for name, tensor in table.items():
                        if tensor is not None:
                            names.append(f"{kind} {prefix + '.' if prefix else ''}{name}")
                            tensors.append(tensor)
        return frozenset(ids), tuple(names), tuple(tensors)


def _has_address(tensor: torch.Tensor) -> bool:
    try:
        tensor.data_ptr()
    except RuntimeError:
        return False
    return True
