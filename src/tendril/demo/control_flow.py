"""Demo: a data-dependent loop on the device with tendril.while_loop, against host-driven loops.

The loop applies an 8-layer MLP (batch 1) until a step limit held in device memory is reached or the
activations leave a bound, so the host cannot know the trip count. Today users either test the exit
with `.item()` after every eager step, or capture the step as a CUDA graph and still return to the
host after every replay. `tendril.while_loop` captured in a graph becomes a CUDA WHILE node: one
replay runs the whole loop. The loop classes here are shared with the `control-flow` benchmark.
"""

from __future__ import annotations

import torch
from torch import nn

from tendril.demo import DemoSection, Row, SectionResult
from tendril.graphs.capture import capture
from tendril.graphs.control import while_loop
from tendril.utils.timing import time_callable

WIDTH = 256
LAYERS = 8
BOUND = 1e4
"""The activations' bound: the loop also stops (early exit) if any activation grows past it."""


def mlp(device: torch.device, width: int = WIDTH, layers: int = LAYERS) -> nn.Module:
    parts: list[nn.Module] = []
    for _ in range(layers):
        parts += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*parts).to(device).eval()


class MlpLoop:
    """State (step counter, activations); runs while the counter is below `limit` (a device tensor)."""

    def __init__(self, model: nn.Module, limit: torch.Tensor) -> None:
        self.model = model
        self.limit = limit

    def keep_going(self, i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return (i < self.limit) & (h.abs().amax() < BOUND)

    def body(self, i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, torch.tanh(self.model(h))

    def eager(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a) What users write: Python loop, exit tested on the host each step."""
        i, h = torch.zeros((), dtype=torch.int64, device=x.device), x
        while self.keep_going(i, h).item():
            i, h = self.body(i, h)
        return i, h

    def on_device(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        start = torch.zeros((), dtype=torch.int64, device=x.device)
        return while_loop(self.keep_going, self.body, (start, x))


class HostReplayLoop:
    """(b) The step (body + exit test) captured as a CUDA graph, replayed from a host loop that reads the flag."""

    def __init__(self, loop: MlpLoop, x: torch.Tensor) -> None:
        self.loop = loop
        self.i = torch.zeros((), dtype=torch.int64, device=x.device)
        self.h = x.clone()

        def step() -> torch.Tensor:
            i, h = loop.body(self.i, self.h)
            self.i.copy_(i)
            self.h.copy_(h)
            return loop.keep_going(self.i, self.h)

        self.step = capture(step)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.i.zero_()
        self.h.copy_(x)
        running = self.loop.keep_going(self.i, self.h).item()
        while running:
            running = self.step.replay().item()
        return self.i, self.h


class DeviceLoop:
    """(c) tendril.while_loop captured once; a call copies the input in and replays one graph."""

    def __init__(self, loop: MlpLoop, x: torch.Tensor) -> None:
        self.x = x.clone()
        self.graph = capture(loop.on_device, self.x)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.x.copy_(x)
        i, h = self.graph.replay()
        return i, h


def run(device: torch.device, quick: bool) -> SectionResult:
    torch.manual_seed(0)
    steps = 20 if quick else 100
    reps = 3 if quick else 20
    with torch.inference_mode():
        loop = MlpLoop(mlp(device), torch.tensor(steps, device=device))
        x = torch.randn(1, WIDTH, device=device)
        ref_i, ref_h = loop.eager(x)
        detail = f"{steps} steps of an {LAYERS}-layer MLP, batch 1"
        eager = time_callable(loop.eager, [(x,)], device=device, warmup=1, reps=reps)
        rows = [Row("eager loop, .item() exit test per step", detail, eager.median_ms, baseline=True)]
        if device.type != "cuda":
            i, h = while_loop(
                loop.keep_going, loop.body, (torch.tensor(0), x), max_iterations=steps, lowering="predication"
            )
            err = (h - ref_h).abs().max().item()
            rows.append(
                Row(
                    "tendril.while_loop, predicated",
                    f"unrolled x{steps}, no host test",
                    None,
                    check=f"{int(i)} steps (eager {int(ref_i)}), max |err| {err:.1e}",
                )
            )
            return SectionResult(
                "Data-dependent loops on the device",
                rows,
                ["CUDA conditional nodes need an NVIDIA GPU: only the CPU lowerings ran here."],
            )
        for variant, fn in (
            ("step graph replayed from a host loop", HostReplayLoop(loop, x)),
            ("tendril.while_loop: one WHILE-node graph", DeviceLoop(loop, x)),
        ):
            i, h = fn(x)
            check = f"{int(i)} steps (eager {int(ref_i)}), max |err| {(h - ref_h).abs().max().item():.1e}"
            timing = time_callable(fn, [(x,)], device=device, warmup=1, reps=reps)
            rows.append(Row(variant, detail, timing.median_ms, check=check))
    return SectionResult("Data-dependent loops on the device", rows)


SECTION = DemoSection(order=30, title="Data-dependent loops on the device", run=run)
