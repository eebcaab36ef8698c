"""Demo: many graphs in little device memory.

GPT-2 with one graph per length. Every instantiated CUDA graph holds driver memory of its own;
`tendril.graphed(model, memory="16MiB")` keeps the captured graphs on the host and gives them executables on
demand within that budget (instantiating while it has room, then switching executables of one topology by
updates), with results identical to one executable per graph.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from tendril.demo import DemoSection, Row, SectionResult
from tendril.demo.models import eager_fallback_note, gpt2
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.utils.device_memory import device_memory_in_use
from tendril.utils.timing import time_callable

MIB = 1 << 20
TITLE = "Many graphs in little memory"


def run(device: torch.device, quick: bool) -> SectionResult:
    torch.manual_seed(0)
    rng = random.Random(0)
    model, vocab = gpt2(device)
    lengths = list(range(1, 17 if quick else 257))
    sequence = [rng.choice(lengths) for _ in range(16 if quick else 128)]
    inputs = [(torch.randint(0, vocab, (1, n), device=device),) for n in sequence]
    reps = len(inputs)
    notes = [f"GPT-2, batch 1, one graph per length 1..{lengths[-1]}, called at random lengths"]
    with torch.inference_mode():
        eager = time_callable(model, inputs, device=device, warmup=2, reps=reps)
        rows = [Row("eager PyTorch", "kernels launched from the CPU", eager.median_ms, baseline=True)]
        if device.type != "cuda":
            notes.append(eager_fallback_note(model, inputs[0], memory="16MiB"))
            return SectionResult(TITLE, rows, notes)
        dedicated, dedicated_row = _graphed_row(model, inputs, lengths, device, reps, None)
        budgeted, budgeted_row = _graphed_row(model, inputs, lengths, device, reps, "16MiB")
        same = all(torch.equal(budgeted(*x).logits, dedicated(*x).logits.clone()) for x in inputs[:8])
        rows += [dedicated_row, dataclasses.replace(budgeted_row, check=f"identical to dedicated executables: {same}")]
    return SectionResult(TITLE, rows, notes)


def _graphed_row(
    model: torch.nn.Module,
    inputs: list[tuple[torch.Tensor]],
    lengths: list[int],
    device: torch.device,
    reps: int,
    budget: str | None,
) -> tuple[GraphedCallable, Row]:
    base = device_memory_in_use(device)
    fast = graphed(model, max_graphs=len(lengths), memory=budget)
    fast.capture([(torch.zeros(1, n, dtype=torch.long, device=device),) for n in lengths], progress=False)
    used = (device_memory_in_use(device) - base) / MIB
    timing = time_callable(fast, inputs, device=device, warmup=2, reps=reps)
    stats = fast.stats
    if budget is None:
        detail = f"{stats.captures} executables: {used:.0f} MiB (driver {stats.driver_bytes / MIB:.0f} MiB)"
        return fast, Row("tendril.graphed", detail, timing.median_ms)
    memory = [r.memory for r in stats.graphs.values()]
    detail = (
        f"budget {budget}: {used:.0f} MiB, {sum(m.instantiations for m in memory)} instantiations, "
        f"{sum(m.evictions for m in memory)} evictions, switching {stats.switch_ms:.1f} ms in all"
    )
    return fast, Row("tendril.graphed, memory budget", detail, timing.median_ms)


SECTION = DemoSection(order=15, title=TITLE, run=run)
