"""Demo: a model whose input length changes every call, as CUDA graphs.

GPT-2 at random lengths, batch 1. Today's choices: eager PyTorch (every kernel launched from the
CPU), or one `torch.cuda.graph` per length, each with its own memory pool. `tendril.graphed`
captures one graph per length into a single shared pool, largest first, and dispatches by shape.
"""

from __future__ import annotations

import random

import torch
from torch.nn.attention import sdpa_kernel

from tendril.demo import DemoSection, Row, SectionResult
from tendril.demo.models import eager_fallback_note, gpt2
from tendril.graphs.callable import graphed
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS
from tendril.utils.device_memory import device_memory_in_use
from tendril.utils.timing import time_callable

MIB = 1 << 20


def run(device: torch.device, quick: bool) -> SectionResult:
    torch.manual_seed(0)
    rng = random.Random(0)
    model, vocab = gpt2(device)
    lengths = list(range(1, 17 if quick else 129))
    sequence = [rng.choice(lengths) for _ in range(16 if quick else 64)]
    inputs = [(torch.randint(0, vocab, (1, n), device=device),) for n in sequence]
    reps = 8 if quick else 4 * len(inputs)
    notes = [f"GPT-2, batch 1, a random sequence of lengths 1..{lengths[-1]} ({len(lengths)} shapes)"]
    with torch.inference_mode():
        eager = time_callable(model, inputs, device=device, warmup=2, reps=reps)
        rows = [Row("eager PyTorch", "kernels launched from the CPU", eager.median_ms, baseline=True)]
        if device.type != "cuda":
            notes.append(eager_fallback_note(model, inputs[0]))
            return SectionResult("Dynamic shapes as CUDA graphs", rows, notes)
        rows += _graphed_rows(model, vocab, inputs, lengths, device, reps)
    return SectionResult("Dynamic shapes as CUDA graphs", rows, notes)


def _graphed_rows(
    model: torch.nn.Module,
    vocab: int,
    inputs: list[tuple[torch.Tensor]],
    lengths: list[int],
    device: torch.device,
    reps: int,
) -> list[Row]:
    base = device_memory_in_use(device)
    per_length = {}
    for n in lengths:
        placeholder = torch.randint(0, vocab, (1, n), device=device)
        with sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):  # the attention kernels tendril captures with
            model(placeholder)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = model(placeholder).logits
        per_length[n] = (graph, placeholder, logits)
    separate_mib = (device_memory_in_use(device) - base) / MIB

    def replay_own_pool(ids: torch.Tensor) -> torch.Tensor:
        graph, placeholder, logits = per_length[ids.shape[1]]
        placeholder.copy_(ids)
        graph.replay()
        return logits

    own = time_callable(replay_own_pool, inputs, device=device, warmup=2, reps=reps)
    per_length.clear()
    base = device_memory_in_use(device)
    fast = graphed(model, max_graphs=len(lengths))
    fast.capture([(torch.zeros(1, n, dtype=torch.long, device=device),) for n in lengths])
    tendril_mib = (device_memory_in_use(device) - base) / MIB
    timing = time_callable(fast, inputs, device=device, warmup=2, reps=reps)
    err = max((fast(*x).logits.float() - model(*x).logits.float()).abs().max().item() for x in inputs[:8])
    return [
        Row(
            "torch.cuda.graph per length",
            f"{len(lengths)} graphs, a pool each: {separate_mib:.0f} MiB",
            own.median_ms,
        ),
        Row(
            "tendril.graphed",
            f"{fast.stats.captures} graphs, one shared pool: {tendril_mib:.0f} MiB",
            timing.median_ms,
            check=f"max |logit err| {err:.1e} vs eager (fp16)",
        ),
    ]


SECTION = DemoSection(order=10, title="Dynamic shapes as CUDA graphs", run=run)
