"""What a graphed training step relies on, checked where it can break: fixed addresses, capturable optimizers,
hyperparameters baked into the graphs.

Fixed addresses. Every graph of a step reads and writes the parameters' `.grad` tensors and the optimizer's state
(Adam's moments and step counts, SGD's momentum buffers, a grad scaler's scale) in place. A graph holds device
addresses, not Python objects, so these tensors must exist before any capture, stay the same tensors for the life of
the step, and live outside the graphs' shared pool (whose blocks every graph reuses as scratch space):

- `.grad` is allocated here, as zeros, before the first step (`allocate_grads`). Backward then accumulates into it
  in place (autograd adds into an existing `.grad` outside grad mode), and the step function must clear it with
  `optimizer.zero_grad(set_to_none=False)`: setting it to None makes the next backward take a fresh buffer, in the
  pool while capturing;
- optimizer state is made lazily by the optimizer's first `step()`, which runs eagerly (the first call at every
  key runs eagerly), so outside the pool; likewise a grad scaler's scale and growth tracker.

`AddressBook` records these tensors after the first eager step and raises, naming the tensor and the fix, when one
of them is replaced. The model's own parameters and buffers are bound the same way, from the step's creation:
`check_model_tensors` raises once one was replaced or moved (`tendril.graphs.module_state`).

Capturable optimizers. An optimizer whose step reads a value on the host (Adam's step count held on the CPU when not
`capturable`) cannot be captured, and `Optimizer.step` refuses to run under a capture unless its groups say
`capturable=True` (even with `fused=True`). `check_optimizer` accepts param groups with `capturable=True`, and
optimizers without that option that keep no host state (`SGD`), and refuses others with the fix in the error.

Hyperparameters. A float learning rate is baked into the captured kernels; an LR scheduler that assigns a new float
would be silently ignored by replays. `Hyperparameters` remembers the groups' scalar settings at capture and raises at
the next call if they changed: pass `lr` as a tensor (`lr=torch.tensor(1e-3, device=...)`; schedulers then update it
in place, which every replay reads).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tendril.graphs.module_state import ModuleState

HOST_STATE_FREE = (torch.optim.SGD,)
"""Optimizers whose step keeps no value on the host (SGD's state is its momentum buffers), capturable as they are."""


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise `TypeError`/`ValueError` unless every param group of `optimizer` can be captured.

    Optimizers with a `capturable` option need it on: `Optimizer.step` refuses to run under a capture otherwise
    (its capture health check), `fused=True` alone included. `fused=True` as well lets `torch.amp.GradScaler` skip
    steps on the device (`scaler`)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    name = type(optimizer).__name__
    for index, group in enumerate(optimizer.param_groups):
        if group.get("capturable"):
            continue
        if "capturable" not in group and isinstance(optimizer, HOST_STATE_FREE):
            continue
        fix = (
            f"create it with capturable=True (e.g. torch.optim.{name}(params, ..., capturable=True, fused=True); "
            "fused=True alone is not enough)"
            if "capturable" in group
            else "use an optimizer with a capturable option (torch.optim.AdamW, Adam, ...) or SGD"
        )
        raise ValueError(
            f"optimizer {name} param group {index} is not capturable: its step keeps state on the host (a CPU step "
            f"count) or refuses to run under a CUDA graph capture; {fix}"
        )


def trained_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """The parameters a step trains: the model's and the optimizer's that require grad, each once, in order."""
    found: dict[int, torch.Tensor] = {}
    groups: Iterable[dict[str, Any]] = optimizer.param_groups if optimizer is not None else ()
    for parameter in (*model.parameters(), *(p for group in groups for p in group["params"])):
        if isinstance(parameter, torch.Tensor) and parameter.requires_grad:
            found.setdefault(id(parameter), parameter)
    return list(found.values())


def allocate_grads(parameters: Iterable[torch.Tensor]) -> None:
    """Give every parameter without a `.grad` a zero one, outside any graph pool (see the module docstring)."""
    with torch.no_grad():
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)


def optimizer_ready(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer has made its state for every parameter a step trains (those with a gradient; at least
    one): its first effective step has run. A step a grad scaler skipped (inf/NaN gradients) makes no state for a
    non-fused optimizer, so this stays False after it."""
    if optimizer is None:
        return True
    trained = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return bool(trained) and all(len(optimizer.state.get(p, {})) > 0 for p in trained)


def state_tensors(optimizer: torch.optim.Optimizer | None, scaler: Any = None) -> dict[str, torch.Tensor]:
    """The optimizer's (and grad scaler's) state tensors by a readable name."""
    found: dict[str, torch.Tensor] = {}
    if optimizer is not None:
        for g, group in enumerate(optimizer.param_groups):
            for i, parameter in enumerate(group["params"]):
                for name, value in optimizer.state.get(parameter, {}).items():
                    if isinstance(value, torch.Tensor):
                        found[f"optimizer state[group {g}, param {i}][{name!r}]"] = value
    for name in ("_scale", "_growth_tracker"):
        value = getattr(scaler, name, None)
        if isinstance(value, torch.Tensor):
            found[f"scaler.{name}"] = value
    return found


class AddressBook:
    """The addresses of the gradients and state tensors the graphs of a step hold (see the module docstring)."""

    def __init__(self, parameters: list[torch.Tensor]) -> None:
        self._parameters = parameters
        self._grads: list[torch.Tensor | None] = [p.grad for p in parameters]
        self._state: dict[str, int] = {}

    def record_state(self, optimizer: torch.optim.Optimizer | None, scaler: Any = None) -> None:
        """Remember the optimizer's and scaler's state tensors (after an eager step has made them)."""
        self._state = {name: tensor.data_ptr() for name, tensor in state_tensors(optimizer, scaler).items()}

    def grads_in_place(self) -> bool:
        """Cheap check at every call: each parameter still has the `.grad` tensor it had at the first step."""
        return all(p.grad is g for p, g in zip(self._parameters, self._grads, strict=True))

    def verify(self, optimizer: torch.optim.Optimizer | None, scaler: Any = None) -> None:
        """Raise `RuntimeError` naming the first gradient or state tensor no longer in place."""
        for index, (parameter, grad) in enumerate(zip(self._parameters, self._grads, strict=True)):
            if parameter.grad is grad:
                continue
            what = "None" if parameter.grad is None else "another tensor"
            raise RuntimeError(
                f"the .grad of trained parameter {index} {tuple(parameter.shape)} is now {what}: graphs hold its "
                "address. Clear gradients with optimizer.zero_grad(set_to_none=False) (or model.zero_grad("
                "set_to_none=False)) in the step function and nowhere assign .grad"
            )
        now = state_tensors(optimizer, scaler)
        for name, address in self._state.items():
            tensor = now.get(name)
            if tensor is None or tensor.data_ptr() != address:
                raise RuntimeError(
                    f"{name} is not the tensor the first step made: graphs hold its address. Update optimizer "
                    "and scaler state in place (no load_state_dict or new tensors between graphed steps)"
                )


def hyperparameters(optimizer: torch.optim.Optimizer | None) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """The scalar settings of each param group (tensor settings such as a tensor `lr` are read by the graphs)."""
    if optimizer is None:
        return ()
    return tuple(
        tuple(sorted((k, v) for k, v in group.items() if k != "params" and isinstance(v, (int, float, bool))))
        for group in optimizer.param_groups
    )


def check_hyperparameters(captured: tuple[Any, ...], optimizer: torch.optim.Optimizer | None) -> None:
    """Raise `RuntimeError` if a param group's scalar setting changed since the graphs were captured."""
    now = hyperparameters(optimizer)
    if now == captured:
        return
    for g, (before, after) in enumerate(zip(captured, now, strict=False)):
        changed = sorted(set(before) ^ set(after))
        if changed:
            names = ", ".join(sorted({k for k, _ in changed}))
            raise RuntimeError(
                f"optimizer param group {g} changed {names} after graphs were captured with the old value(s): "
                "graph replays would ignore the change. Pass such settings as tensors (lr=torch.tensor(1e-3, "
                "device=...)) and update them in place (schedulers do)"
            )
    raise RuntimeError("the optimizer's param groups changed after graphs were captured (groups added or removed)")


def check_model_tensors(modules: ModuleState, step: str) -> None:
    """Raise `RuntimeError` naming the first of the model's tensors replaced or moved since the step was made."""
    change = modules.changed_tensors()
    if change is not None:
        raise RuntimeError(
            f"{step}: {change} since the step was made; its gradients, optimizer state and graphs are bound to the "
            "model's tensors as they were. Load new values in place (load_state_dict without assign=True, "
            "param.data.copy_(...)), or make the optimizer and the graphed step again after replacing or moving them"
        )
