"""Loss scaling for fp16 AMP inside graphed steps: inf/NaN checks and step skipping on the device.

`torch.amp.GradScaler` has two paths (torch/amp/grad_scaler.py):

- a fused optimizer (`fused=True`: Adam, AdamW, SGD, Adagrad set `_step_supports_amp_scaling`; Adam and AdamW also
  need `capturable=True` to be captured at all): `scaler.step`
  hands the scale and a device `found_inf` to the optimizer, whose fused kernel unscales, checks and skips the update
  on the device (the step count it adds is taken back on the device too), and `scaler.update` adjusts the scale with
  `torch._amp_update_scale_`, on the device. Neither reads a value on the host: it can be captured as it is;
- any other optimizer (`capturable=True` without `fused`): `scaler.step` calls `_maybe_opt_step`, which decides
  whether to step with `found_inf.item()`, a host synchronisation that breaks a capture.

`DeviceGradScaler` is a `GradScaler` for the second case: it always runs the optimizer's step, then puts back, on the
device, the parameters and optimizer state the step changed where `found_inf` is set (`torch.where` against copies
taken before the step). The result equals GradScaler's skip; the price is one copy of the parameters and optimizer
state per step, so prefer a fused optimizer when it exists. While the optimizer has no state yet (before its first
step) there is nothing to restore it to, so that step takes GradScaler's host path: it runs eagerly in a graphed step
(`tendril.graphs.training.step`), never captured.

`check_scaler` refuses the combination that would sync (a plain GradScaler with a non-fused optimizer), naming the
fix, and `reset_after_failed_capture` clears the per-step bookkeeping a capture that failed half-way left behind.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch.amp import GradScaler

from tendril.utils.checks import is_finite_number, is_integer


class DeviceGradScaler(GradScaler):
    """`torch.amp.GradScaler` whose `step` skips an overflowing update on the device (see the module docstring).

    Its arguments are GradScaler's, checked where GradScaler takes any value: a scale that is not a positive finite
    number would zero or negate every gradient, and a growth interval that is not a positive integer would never grow
    the scale, both without an error."""

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True) -> None:
        if not (is_finite_number(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale!r}")
        if not is_integer(growth_interval) or growth_interval < 1:
            raise ValueError(f"growth_interval must be a positive integer (steps), got {growth_interval!r}")
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval, enabled)

    def _maybe_opt_step(
        self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any, **kwargs: Any
    ) -> Any:
        live = _restorable(optimizer)
        if live is None:
            return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)
        scale = self._scale
        assert scale is not None
        found = [t.to(scale.device, non_blocking=True) for t in optimizer_state["found_inf_per_device"].values()]
        skip = torch.stack(found).sum() > 0
        saved = [tensor.clone() for tensor in live]
        result = optimizer.step(*args, **kwargs)
        with torch.no_grad():
            for tensor, before in zip(live, saved, strict=True):
                tensor.copy_(torch.where(skip, before, tensor))
        return result


def _restorable(optimizer: torch.optim.Optimizer) -> list[torch.Tensor] | None:
    """The tensors an optimizer step writes (parameters with a gradient, and their state), or None while any of them
    has no state yet."""
    tensors: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            if parameter.grad is None:
                continue
            state = optimizer.state.get(parameter)
            if not state:
                return None
            tensors.append(parameter.data)
            tensors += [value for value in state.values() if isinstance(value, torch.Tensor)]
    return tensors


def sync_free(scaler: GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Whether `scaler.step(optimizer)` and `scaler.update()` run without reading a value on the host."""
    if not scaler.is_enabled() or isinstance(scaler, DeviceGradScaler):
        return True
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def check_scaler(scaler: Any, optimizer: torch.optim.Optimizer | None) -> None:
    """Raise `TypeError`/`ValueError` unless `scaler` can be captured with `optimizer`."""
    if scaler is None:
        return
    if not isinstance(scaler, GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or tendril's DeviceGradScaler), got {type(scaler)}")
    if optimizer is None:
        raise ValueError("scaler= needs optimizer=: the scaler's step and update run with the optimizer's")
    if not sync_free(scaler, optimizer):
        raise ValueError(
            f"torch.amp.GradScaler with the non-fused {type(optimizer).__name__} decides whether to step with "
            "found_inf.item() (GradScaler._maybe_opt_step), a host sync that breaks the capture: create the "
            "optimizer with fused=True (and capturable=True), or use tendril.DeviceGradScaler, which skips "
            "overflowing steps on the device"
        )


def reset_after_failed_capture(scaler: Any) -> None:
    """Forget the stage (unscaled, stepped) a capture that failed between `scaler.scale` and `scaler.update` left in
    the scaler's per-optimizer bookkeeping, so that the call's eager run starts a fresh step."""
    if isinstance(scaler, GradScaler):
        from torch.amp.grad_scaler import _refresh_per_optimizer_state

        scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)
