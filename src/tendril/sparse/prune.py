"""Magnitude pruning of a CNN's Conv2d and Linear weights to per-layer densities.

`prune(model, densities)` keeps, in every prunable layer, the weights of largest magnitude (exactly
`round(density * numel)` of them) and zeroes the rest in place. `densities` is one of:

- a float: the same density for every layer (e.g. 0.2 for 80% uniform weight sparsity);
- a preset name: the Deep Compression densities (Han et al.) for `"alexnet"` or `"vgg16"`, layer by
  layer in module order (convolutions then fully-connected layers);
- a sequence with one density per prunable layer, in module order;
- a mapping from layer name (as in `named_modules`) to density; layers not named are left alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

DEEP_COMPRESSION: dict[str, tuple[float, ...]] = {
    "alexnet": (0.84, 0.38, 0.35, 0.37, 0.37, 0.09, 0.09, 0.25),
    "vgg16": (0.58, 0.22, 0.34, 0.36, 0.53, 0.24, 0.42, 0.32, 0.27, 0.34, 0.35, 0.29, 0.36, 0.04, 0.04, 0.23),
}


@dataclass(frozen=True)
class PrunedLayer:
    name: str
    kind: str
    target: float
    density: float
    """Fraction of the layer's weights that are nonzero after pruning."""


def prunable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]


def _targets(
    layers: list[tuple[str, nn.Module]], densities: float | str | Sequence[float] | Mapping[str, float]
) -> dict[str, float]:
    names = [name for name, _ in layers]
    if isinstance(densities, str):
        if densities not in DEEP_COMPRESSION:
            raise ValueError(f"unknown pruning preset {densities!r}: expected one of {sorted(DEEP_COMPRESSION)}")
        densities = DEEP_COMPRESSION[densities]
    if isinstance(densities, (int, float)):
        return dict.fromkeys(names, float(densities))
    if isinstance(densities, Mapping):
        unknown = sorted(set(densities) - set(names))
        if unknown:
            raise ValueError(f"no Conv2d or Linear layer named {unknown}; prunable layers: {names}")
        return {name: float(d) for name, d in densities.items()}
    if len(densities) != len(names):
        raise ValueError(f"{len(densities)} densities given for {len(names)} prunable layers ({names})")
    return dict(zip(names, map(float, densities), strict=True))


@torch.no_grad()
def prune(model: nn.Module, densities: float | str | Sequence[float] | Mapping[str, float]) -> list[PrunedLayer]:
    """Zero all but the largest-magnitude weights of each Conv2d/Linear layer; returns what was kept."""
    layers = prunable_layers(model)
    targets = _targets(layers, densities)
    for name, density in targets.items():  # every density checked before any layer changes
        if not 0.0 <= density <= 1.0:
            raise ValueError(f"layer {name}: density {density} is not in [0, 1]")
    report = []
    for name, module in layers:
        if name not in targets:
            continue
        density = targets[name]
        weight: torch.Tensor = module.weight  # type: ignore[assignment]
        keep = round(density * weight.numel())
        flat = weight.view(-1)
        if keep < flat.numel():
            mask = torch.zeros_like(flat, dtype=torch.bool)
            mask[torch.topk(flat.abs(), keep, sorted=False).indices] = True
            flat.masked_fill_(~mask, 0.0)
        kind = "conv" if isinstance(module, nn.Conv2d) else "linear"
        report.append(PrunedLayer(name, kind, density, float(torch.count_nonzero(weight)) / weight.numel()))
    return report
