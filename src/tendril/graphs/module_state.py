"""Whether the modules a graph was captured over are still as the graph reads them.

A captured graph reads every parameter and buffer at the address it had during capture, and runs the kernels of the
training mode each module was in. Three kinds of change leave replays returning wrong results without an error:

- a tensor or submodule is *replaced*: `module.weight = nn.Parameter(...)`, `load_state_dict(..., assign=True)`,
  a submodule swapped for another (adapters, `ModuleList` assignment). The graph reads the old tensor's memory,
  which may be freed and reused;
- a tensor's memory *moves*: `.to()`, `.half()`, `.cpu()` then `.cuda()`, `param.data = ...`. Likewise;
- a module's *mode* flips: `model.train()`, or dropout layers switched on for Monte Carlo dropout. The graph keeps
  the kernels of the mode it was captured in.

`ModuleState` records the modules' tensors, their addresses and the modules' modes; `changed()` says what changed
since, for about the cost of reading each tensor's address and each module's flag. Replacements are flagged by
PyTorch's global registration hooks (installed once, they mark the watchers of the module being assigned to), moves
and modes by comparison. Writes into the same memory (in place, `copy_`, through `.data`) are what graphs are for
and are not changes. Assignments that bypass `nn.Module.__setattr__` and `register_*` (writing `module._parameters`
directly) are not seen.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as torch_module


class ModuleChangedWarning(UserWarning):
    """Modules that graphs or decode loops were built over changed (tensors replaced or moved, or a mode flipped), so
    those are built again."""


_watchers: weakref.WeakSet[ModuleState] = weakref.WeakSet()
"""Every live `ModuleState`, which the registration hooks mark."""
_hooks_installed = False
_training = operator.attrgetter("training")


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


class ModuleState:
    """The parameters and buffers of `modules` (with their submodules), where their memory is, and the modules'
    training modes (module docstring). `tensors` are the current ones as of the last `renew()`; `changed()` reports
    a replacement, a move or a mode flip since."""

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
        self._submodules: tuple[tuple[str, nn.Module], ...] = ()
        self._module_list: tuple[nn.Module, ...] = ()
        self._modes: list[bool] = []
        _install_hooks()
        _watchers.add(self)
        self.renew()

    def renew(self) -> None:
        """Record the modules' tensors, addresses and modes as they are now."""
        self._submodules, self._names, self.tensors = self._walk()
        self.module_ids = frozenset(id(module) for _, module in self._submodules)
        located = [(n, t) for n, t in zip(self._names, self.tensors, strict=True) if _has_address(t)]
        self._located_names = tuple(name for name, _ in located)
        self._located = tuple(tensor for _, tensor in located)
        self._addresses = [tensor.data_ptr() for tensor in self._located]
        self._module_list = tuple(module for _, module in self._submodules)
        self._modes = [module.training for module in self._module_list]
        self.assigned = None

    def changed(self) -> str | None:
        """What changed since the last `renew`: `changed_tensors()`, else `changed_mode()`."""
        return self.changed_tensors() or self.changed_mode()

    def changed_tensors(self) -> str | None:
        """The first tensor replaced, or the first whose memory moved, since the last `renew`, or None. An assignment
        that put back the same tensors (re-tying weights) is no change."""
        if self.assigned is not None:
            submodules, names, tensors = self._walk()
            if names != self._names or any(a is not b for a, b in zip(tensors, self.tensors, strict=True)):
                pairs = zip(names, tensors, self.tensors, strict=False)
                replaced = next((name for name, a, b in pairs if a is not b), "a tensor of the modules")
                return f"{replaced} was replaced ({self.assigned})"
            if [m for _, m in submodules] != list(self._module_list):
                return f"a submodule was replaced ({self.assigned})"
            self.assigned = None
        addresses = list(map(torch.Tensor.data_ptr, self._located))
        if addresses == self._addresses:
            return None
        moved = next(i for i, (a, b) in enumerate(zip(addresses, self._addresses, strict=True)) if a != b)
        return f"the memory of {self._located_names[moved]} moved"

    def changed_mode(self) -> str | None:
        """The first module whose training mode flipped since the last `renew`, or None."""
        modes = list(map(_training, self._module_list))
        if modes == self._modes:
            return None
        flipped = next(i for i, (a, b) in enumerate(zip(modes, self._modes, strict=True)) if a != b)
        name, module = self._submodules[flipped]
        return f"{name or type(module).__name__} switched to {'training' if modes[flipped] else 'eval'} mode"

    def _walk(self) -> tuple[tuple[tuple[str, nn.Module], ...], tuple[str, ...], tuple[torch.Tensor, ...]]:
        """The modules and submodules with their names, and the names and tensors of their parameters and buffers."""
        submodules, names, tensors = [], [], []
        for root in self.modules:
            for prefix, module in root.named_modules(remove_duplicate=False):
                submodules.append((prefix, module))
                for kind, table in (("parameter", module._parameters), ("buffer", module._buffers)):
                    for name, tensor in table.items():
                        if tensor is not None:
                            names.append(f"{kind} {prefix + '.' if prefix else ''}{name}")
                            tensors.append(tensor)
        return tuple(submodules), tuple(names), tuple(tensors)


def _has_address(tensor: torch.Tensor) -> bool:
    try:
        tensor.data_ptr()
    except RuntimeError:
        return False
    return True
