"""Demo: launch overhead at batch 1, eager PyTorch against one replayed CUDA graph.

A deep, narrow MLP launches many tiny kernels; eager execution pays the CPU's launch cost for each,
a CUDA graph replays them all with one launch. This is the problem the rest of tendril builds on.
"""

from __future__ import annotations

import torch
from torch import nn

from tendril.demo import DemoSection, Row, SectionResult
from tendril.graphs.capture import capture
from tendril.utils.timing import time_callable

LAYERS = 50
WIDTH = 256


def _model(device: torch.device) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers).to(device).eval()


def run(device: torch.device, quick: bool) -> SectionResult:
    torch.manual_seed(0)
    model = _model(device)
    reps = 20 if quick else 200
    x = torch.randn(1, WIDTH, device=device)
    with torch.inference_mode():
        eager = time_callable(model, [(x,)], device=device, warmup=3, reps=reps)
        rows = [Row("eager PyTorch", f"{LAYERS}-layer MLP, batch 1", eager.median_ms, baseline=True)]
        notes = []
        if device.type == "cuda":
            rows.append(_graphed_row(model, x, device, reps))
        else:
            notes.append("CUDA graph replay needs an NVIDIA GPU: only the eager CPU path ran here.")
    return SectionResult("Launch overhead at batch 1", rows, notes)


def _graphed_row(model: nn.Module, x: torch.Tensor, device: torch.device, reps: int) -> Row:
    static_x = x.clone()
    captured = capture(model, static_x)
    err = (captured.replay() - model(x)).abs().max().item()
    timing = time_callable(captured.graph.replay, device=device, warmup=3, reps=reps)
    return Row("CUDA graph replay", "same model, one launch", timing.median_ms, check=f"max |err| {err:.1e} vs eager")


SECTION = DemoSection(order=0, title="Launch overhead at batch 1", run=run)
