"""LayerDrop that draws on the device, so that graphed training steps skip layers anew at every replay.

HF's encoders and decoders (Wav2Vec2, HuBERT, WavLM, BART, Whisper, ...) decide LayerDrop on the host: per layer
and step, `torch.rand([])` on the CPU generator against the module's probability (`self.layerdrop`, or
`self.config.layerdrop`), and Python skips the layer's call. A CUDA graph records one such decision, made while it
was captured, and replays it at every step: the same layers would be skipped forever.

`layerdrop_on_device(model)` moves the decision into the graph. Every module with a `layers` list and a positive
LayerDrop probability gets probability 0 on the host (the module's own attribute, or a copy of its config, so the
model's config and checkpoints keep the real value) and a forward hook on each of its layers that, in training,
draws on the layer input's device and keeps the layer's output with probability `1 - p`, else passes the input
through (`torch.where`): a dropped layer's parameters get zero gradients, as with `zero_grad(set_to_none=False)`
in eager LayerDrop. The device's generator is graph-safe, so each replay draws fresh numbers. The cost: a
dropped layer still runs (its result is discarded), so steps do not get cheaper as with eager LayerDrop.
Parameter names, and so state dicts, are unchanged; `remove()` restores the host-side LayerDrop.

`host_layerdrop(model)` names the modules whose LayerDrop still draws on the host (`graphed_step` warns of them).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle


class HostLayerDropWarning(UserWarning):
    """The trained model decides LayerDrop on the host: each graph would skip the same layers at every replay."""


def _probability(module: nn.Module) -> tuple[str, float] | None:
    """Where `module` keeps its host-side LayerDrop probability ("attribute" or "config") and its value, for a
    module with a `layers` list and a positive probability; else None."""
    if not isinstance(getattr(module, "layers", None), nn.ModuleList):
        return None
    own = getattr(module, "layerdrop", None)
    if isinstance(own, (int, float)) and not isinstance(own, bool):
        return ("attribute", float(own)) if own > 0 else None
    configured = getattr(getattr(module, "config", None), "layerdrop", None)
    if isinstance(configured, (int, float)) and not isinstance(configured, bool) and configured > 0:
        return "config", float(configured)
    return None


def _with_layerdrop(model: nn.Module) -> Iterator[tuple[str, Any, str, float]]:
    """`(name, module, where, p)` for every module of `model` that `_probability` finds (typed Any: HF's modules
    declare neither `layers` nor `layerdrop`)."""
    for name, module in model.named_modules():
        found = _probability(module)
        if found is not None:
            yield name, module, *found


def host_layerdrop(model: nn.Module) -> list[str]:
    """The names of `model`'s modules whose LayerDrop draws on the host (`layerdrop_on_device` moves it)."""
    return [name or type(model).__name__ for name, *_ in _with_layerdrop(model)]


class _DeviceDrop:
    """The forward hook of one layer: keep its output with probability `1 - p` in training, drawn on the device."""

    def __init__(self, p: float) -> None:
        if not 0.0 < p < 1.0:
            raise ValueError(f"a LayerDrop probability must lie in (0, 1), got {p}")
        self.p = p

    def __call__(self, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if not layer.training:
            return output
        hidden = args[0] if args else kwargs.get("hidden_states")
        result = output[0] if isinstance(output, tuple) else output
        if not isinstance(hidden, torch.Tensor) or not isinstance(result, torch.Tensor):
            raise TypeError(f"{type(layer).__name__}: device LayerDrop needs the hidden states as the layer's first "
                            "argument and its (first) output")  # fmt: skip
        if result.shape != hidden.shape:
            raise ValueError(f"{type(layer).__name__}: a layer LayerDrop may skip must keep the shape of its input, "
                             f"{tuple(hidden.shape)} -> {tuple(result.shape)}")  # fmt: skip
        keep = torch.rand((), device=hidden.device) >= self.p
        chosen = torch.where(keep, result, hidden.to(result.dtype))
        return (chosen, *output[1:]) if isinstance(output, tuple) else chosen


@dataclass
class DeviceLayerDrop:
    """What `layerdrop_on_device` changed: the modules (by name) and their probabilities; `remove()` undoes it."""

    probabilities: dict[str, float] = field(default_factory=dict)
    _hooks: list[RemovableHandle] = field(default_factory=list, repr=False)
    _restore: list[tuple[nn.Module, str, Any]] = field(default_factory=list, repr=False)

    @property
    def layers(self) -> int:
        """Layers that draw on the device."""
        return len(self._hooks)

    def remove(self) -> None:
        """Put LayerDrop back on the host, as the model had it."""
        for hook in self._hooks:
            hook.remove()
        for module, attribute, value in reversed(self._restore):
            setattr(module, attribute, value)
        self._hooks.clear()
        self._restore.clear()
        self.probabilities.clear()


def layerdrop_on_device(model: nn.Module) -> DeviceLayerDrop:
    """Move every host-side LayerDrop in `model` onto the device (see the module docstring); idempotent."""
    done = DeviceLayerDrop()
    for name, module, where, p in list(_with_layerdrop(model)):
        if where == "attribute":
            done._restore.append((module, "layerdrop", module.layerdrop))
            module.layerdrop = 0.0
        else:
            done._restore.append((module, "config", module.config))
            config = copy.copy(module.config)
            config.layerdrop = 0.0
            module.config = config
        hook = _DeviceDrop(p)
        for layer in module.layers:
            done._hooks.append(layer.register_forward_hook(hook, with_kwargs=True))
        done.probabilities[name or type(model).__name__] = p
    return done
