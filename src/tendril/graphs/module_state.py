"""Whether the modules a graph was captured over are still as the graph reads them.

A captured graph reads every parameter and buffer at the address it had during capture, and runs the kernels of the
training mode each module was in. Three kinds of change leave replays returning wrong results without an error:

- a tensor or submodule is *replaced*: `module.weight = nn.Parameter(...)`, `load_state_dict(..., assign=True)`,
  a submodule swapped for another (adapters, `ModuleList` assignment). The graph reads the old tensor's memory,
  which may be freed and reused;
- a tensor's memory *moves*: `.to()`, `.half()`, `.cpu()` then `.cuda()`, `param.data = ...`. Likewise;
- a module's *mode* flips: `model.train()`, or dropout layers switched on for Monte Carlo dropout. The graph keeps
  the kernels of the mode it was captured in.

`ModuleState` records the modules' tensors and modes, holding none of them alive. Checking it costs a few
attribute reads, whatever the model's size, because changes to tensors announce themselves:

- an assignment through PyTorch's global registration hooks (installed once; they flag the records holding the
  module assigned to);
- a tensor replaced without them (`.to()` replaces buffers directly) or a tensor's old memory freed, through weak
  references to each tensor and its storage;
- a move of a whole module (`.to()`, `.half()`), through the address of one tensor of it, read at every check: the
  one signal that works where the old memory lives on elsewhere (weights loaded from another model's state).

Only after a signal are the tensors compared one by one. Modes are read at every check, of the recorded modules
themselves and of their layers that act differently in training (dropout, normalization, `RReLU`,
`MultiheadAttention`).

Not seen, while something else still holds the old tensor or memory (the graph then reads that old, still valid
memory): a tensor written into `module._parameters` or `_buffers` by hand, past the hooks; one tensor's
`param.data = ...`. Not seen at all: a recorded tensor other than a module's first grown by `resize_` (its storage
object stays); a mode flipped on another kind of submodule alone. Writes into the same memory (in place, `copy_`,
through `.data`) are what graphs are for and are not changes.
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


MODE_DEPENDENT = (
    nn.modules.dropout._DropoutNd,
    nn.modules.batchnorm._NormBase,
    nn.RReLU,
    nn.MultiheadAttention,
)
"""PyTorch's layers whose forward reads `self.training`, whose modes a record checks besides its own modules'."""

_records: weakref.WeakSet[ModuleState] = weakref.WeakSet()
"""Every live `ModuleState`, which the registration hooks flag."""
_hooks_installed = False
_training = operator.attrgetter("training")


def _on_registration(module: nn.Module, name: str, value: Any) -> None:
    """PyTorch's global hook for a parameter, buffer or submodule assigned to `module`: flags its records."""
    for record in list(_records):
        if id(module) in record.module_ids:
            record.assigned = record.assigned or f"{type(module).__name__}.{name} was assigned"


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        torch_module.register_module_parameter_registration_hook(_on_registration)
        torch_module.register_module_buffer_registration_hook(_on_registration)
        torch_module.register_module_module_registration_hook(_on_registration)
        _hooks_installed = True


class ModuleState:
    """The parameters and buffers of `modules` (with their submodules), where their memory is, and the modules'
    training modes (module docstring). Holds no tensor alive: a replaced tensor's death is one of its signals."""

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = tuple(modules)
        self.module_ids: frozenset[int] = frozenset()
        self.assigned: str | None = None
        """Set by the registration hooks: an assignment to one of the modules since `renew`."""
        self.freed = False
        """Set when a recorded tensor or its storage was freed since `renew` (replaced, or its memory moved)."""
        self._names: tuple[str, ...] = ()
        self._submodules: tuple[nn.Module, ...] = ()
        self._tensor_refs: list[weakref.ref[torch.Tensor]] = []
        self._addresses: list[int | None] = []
        self._storage_refs: list[weakref.ref[torch.UntypedStorage]] = []
        self._sentinels: list[tuple[weakref.ref[torch.Tensor], int]] = []
        """The first tensor with storage of each module and its address: a whole-model move (`.to()`, a cast) moves
        it even where the old memory lives on elsewhere, so no free signals it."""
        self._mode_modules: tuple[tuple[str, nn.Module], ...] = ()
        self._mode_list: tuple[nn.Module, ...] = ()
        self._modes: list[bool] = []
        _install_hooks()
        _records.add(self)
        self.renew()

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The recorded tensors still alive (all of them until a change)."""
        return tuple(tensor for tensor in (ref() for ref in self._tensor_refs) if tensor is not None)

    def renew(self) -> None:
        """Record the modules' tensors, addresses and modes as they are now."""
        submodules, self._names, tensors = self._walk()
        self._submodules = tuple(module for _, module in submodules)
        self.module_ids = frozenset(map(id, self._submodules))
        flag = _freed_flag(weakref.ref(self))
        self._tensor_refs = [weakref.ref(tensor, flag) for tensor in tensors]
        self._addresses = [_address(tensor) for tensor in tensors]
        located = [(t, a) for t, a in zip(tensors, self._addresses, strict=True) if a is not None]
        self._storage_refs = [weakref.ref(t.untyped_storage(), flag) for t, _ in located]
        self._sentinels = []
        for root in self.modules:
            first = next((t for t in (*root.parameters(), *root.buffers()) if _address(t) is not None), None)
            if first is not None:
                self._sentinels.append((weakref.ref(first), first.data_ptr()))
        roots = {id(root) for root in self.modules}
        self._mode_modules = tuple((name, module) for name, module in submodules
                                   if id(module) in roots or isinstance(module, MODE_DEPENDENT))
        self._mode_list = tuple(module for _, module in self._mode_modules)
        self._modes = [module.training for module in self._mode_list]
        self.assigned, self.freed = None, False

    def changed(self) -> str | None:
        """What changed since the last `renew`: `changed_tensors()`, else `changed_mode()`."""
        return self.changed_tensors() or self.changed_mode()

    def changed_tensors(self) -> str | None:
        """The first tensor replaced, or the first whose memory moved, since the last `renew`, or None. Compares
        tensors one by one only after a signal; a signal that turns out to be no change (the same tensors assigned
        again, as when weights are tied again; memory freed and the new memory at the same address) renews the
        record."""
        if self.assigned is None and not self.freed and self._sentinels_in_place():
            return None
        submodules, names, tensors = self._walk()
        recorded = [ref() for ref in self._tensor_refs]
        if names == self._names:
            same = zip(names, tensors, recorded, self._addresses, strict=True)
            moved = next((name for name, t, r, a in same if t is r and _address(t) != a), None)
            if moved is not None:
                return f"the memory of {moved} moved"
        if names != self._names or any(a is not b for a, b in zip(tensors, recorded, strict=True)):
            pairs = zip(names, tensors, recorded, strict=False)
            replaced = next((name for name, a, b in pairs if a is not b), "a tensor of the modules")
            return f"{replaced} was replaced ({self.assigned or 'the old one was freed'})"
        if [module for _, module in submodules] != list(self._submodules):
            return f"a submodule was replaced ({self.assigned})"
        self.renew()
        return None

    def changed_mode(self) -> str | None:
        """The first module whose training mode flipped since the last `renew`, or None."""
        modes = list(map(_training, self._mode_list))
        if modes == self._modes:
            return None
        flipped = next(i for i, (a, b) in enumerate(zip(modes, self._modes, strict=True)) if a != b)
        name, module = self._mode_modules[flipped]
        return f"{name or type(module).__name__} switched to {'training' if modes[flipped] else 'eval'} mode"

    def modes(self) -> tuple[bool, ...]:
        """The training modes now of the recorded modules and of their layers that act differently in training, in
        module order (each root before its submodules): part of a graph's key where modes select graphs rather than
        invalidate them (`tendril.graphs.training.step`)."""
        return tuple(map(_training, self._mode_list))

    def training_layers(self) -> list[str]:
        """The names of the recorded layers that act differently in training (`MODE_DEPENDENT`; a dropout of p = 0
        aside) and are in training mode now."""
        return [name or type(module).__name__ for name, module in self._mode_modules
                if module.training and isinstance(module, MODE_DEPENDENT) and getattr(module, "p", 1.0) != 0]

    def _sentinels_in_place(self) -> bool:
        for ref, address in self._sentinels:
            tensor = ref()
            if tensor is None or tensor.data_ptr() != address:
                return False
        return True

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


def _freed_flag(record: weakref.ref[ModuleState]) -> Any:
    """The callback of the weak references to a record's storages: flags the record (if it is still alive)."""

    def flag(_: object) -> None:
        alive = record()
        if alive is not None:
            alive.freed = True

    return flag


def _address(tensor: torch.Tensor) -> int | None:
    """Where the tensor's memory is; None for a tensor without storage (a wrapper subclass)."""
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return None
