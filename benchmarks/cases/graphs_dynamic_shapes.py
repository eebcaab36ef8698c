"""Case `graphs-dynamic-shapes`: GPT-2 fp16 forward at every length 1..256 (batch 1), three ways.

- eager PyTorch;
- one `torch.cuda.graph` per length, each with its own pool (what a user of PyTorch's graphs gets),
  inputs copied into that length's placeholder before each replay; captured with the same attention
  kernels as tendril's graphs (`GRAPH_SDPA_BACKENDS`), so the two differ only in how memory is pooled;
- `tendril.graphed`: one shared pool, captured ahead of time largest first, dispatch by shape.

Memory is the device memory in use (cudaMemGetInfo, after emptying the allocator's cache) after
capturing all lengths, so it counts pools, placeholders and the driver's memory for the instantiated
graphs. Per-call times are CUDA-event medians over rotating inputs, measured side by side per length.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.nn.attention import sdpa_kernel

from benchmarks.registry import Context, Goal, register
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS
from tendril.graphs.key import GraphKey
from tendril.utils.device_memory import device_memory_in_use
from tendril.utils.timing import time_callable

MIB = 1 << 20
VOCAB = 50257


def _gpt2(device: torch.device) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(use_cache=False))
    return model.to(device=device, dtype=torch.float16).eval()


class SeparatePools:
    """One graph per length, each captured with `torch.cuda.graph` into its own pool."""

    def __init__(self, model: torch.nn.Module, lengths: list[int], device: torch.device) -> None:
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        for length in lengths:
            placeholder = torch.randint(0, VOCAB, (1, length), device=device)
            with sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    model(placeholder)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    logits = model(placeholder).logits
            self.graphs[length] = (graph, placeholder, logits)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        graph, placeholder, logits = self.graphs[ids.shape[1]]
        placeholder.copy_(ids)
        graph.replay()
        return logits


@register("graphs-dynamic-shapes", "GPT-2 fp16 at lengths 1..256: eager vs a graph+pool per length vs tendril.graphed")
def run(ctx: Context) -> None:
    device = ctx.device
    torch.manual_seed(0)
    lengths = list(range(1, 257)) if not ctx.quick else list(range(1, 257, 15))
    reps = 5 if ctx.quick else 20
    model = _gpt2(device)
    with torch.inference_mode():
        inputs = {n: [(torch.randint(0, VOCAB, (1, n), device=device),) for _ in range(4)] for n in lengths}
        model(inputs[lengths[-1]][0][0])

        base = device_memory_in_use(device)
        fast = graphed(model, max_graphs=len(lengths))
        start = time.perf_counter()
        fast.capture([inputs[n][0] for n in lengths], progress=False)
        torch.cuda.synchronize(device)
        tendril_capture_s = time.perf_counter() - start
        tendril_bytes = device_memory_in_use(device) - base

        base = device_memory_in_use(device)
        start = time.perf_counter()
        separate = SeparatePools(model, lengths, device)
        torch.cuda.synchronize(device)
        separate_capture_s = time.perf_counter() - start
        separate_bytes = device_memory_in_use(device) - base

        first_launch = _first_launch_bytes(fast, inputs, lengths, device)
        speedups = {}
        for n in lengths:
            rows = inputs[n]
            eager = time_callable(model, rows, device=device, warmup=2, reps=reps)
            own_pool = time_callable(separate, rows, device=device, warmup=2, reps=reps)
            shared = time_callable(fast, rows, device=device, warmup=2, reps=reps)
            got, expected = fast(*rows[0]).logits.float(), model(*rows[0]).logits.float()
            error = (got - expected).abs().max().item()
            if error > 5e-2:
                ctx.note(f"length {n}: max |logits error| vs eager {error:.3g}")
            ctx.add_timing(f"eager L={n}", eager)
            ctx.add_timing(f"graph per length L={n}", own_pool)
            ctx.add_timing(f"tendril L={n}", shared)
            speedups[n] = eager.median_ms / shared.median_ms

    records = list(fast.stats.graphs.values())
    driver = [r.driver_bytes or 0 for r in records]
    capture_ms = [r.capture_ms for r in records]
    short = [speedups[n] for n in lengths if n <= 64]
    ctx.add_value("tendril", "device_MiB_after_capture", tendril_bytes / MIB)
    ctx.add_value("graph per length", "device_MiB_after_capture", separate_bytes / MIB)
    ctx.add_value("tendril", "pool_MiB", fast.stats.pool_bytes / MIB)
    ctx.add_value("tendril", "placeholder_MiB", fast.stats.placeholder_bytes / MIB)
    ctx.add_value("tendril", "driver_MiB_total", sum(driver) / MIB)
    ctx.add_value("tendril", "driver_MiB_per_graph_median", statistics.median(driver) / MIB)
    ctx.add_value("tendril", "driver_MiB_per_graph_max", max(driver) / MIB)
    ctx.add_value("tendril", "driver_MiB_at_first_launch_total", first_launch / MIB)
    ctx.add_value("tendril", "capture_ms_per_graph_median", statistics.median(capture_ms))
    for phase in ("warmup", "record", "instantiate"):
        values = [r.phases_ms.get(phase, 0.0) for r in records]
        ctx.add_value("tendril", f"capture_{phase}_ms_median", statistics.median(values))
    ctx.add_value("graph per length", "capture_ms_per_graph", separate_capture_s * 1e3 / len(lengths))
    ctx.add_value("tendril", "speedup_vs_eager_all_lengths_median", statistics.median(speedups.values()))
    without_driver = (separate_bytes - sum(driver)) / max(tendril_bytes - sum(driver), 1)
    ctx.add_value("tendril", "memory_ratio_excluding_driver_memory", without_driver)
    ctx.extra["per_length"] = {
        n: {"speedup": speedups[n], "driver_bytes": fast.stats.graphs[k].driver_bytes}
        for n, k in zip(lengths, _keys_by_length(fast), strict=True)
    }
    ctx.extra["tendril_stats"] = fast.stats.table().splitlines()[0]
    ctx.note("eager runs with PyTorch's default attention kernels; both graph variants with flash/efficient attention")
    ctx.note(
        f"{len(lengths)} lengths; tendril captured {len(records)} graphs in {tendril_capture_s:.2f} s, "
        f"one pool per length in {separate_capture_s:.2f} s"
    )
    ctx.target("speedup_vs_eager_len_le_64", statistics.median(short), Goal(">=", 5))
    ctx.target("memory_ratio_vs_separate_pools", separate_bytes / tendril_bytes, Goal(">=", 10))
    ctx.target("capture_ms_per_graph", tendril_capture_s * 1e3 / len(lengths), Goal("<=", 20))


def _keys_by_length(fast: GraphedCallable) -> list[GraphKey]:
    return sorted(fast.stats.graphs, key=lambda key: key.tensors[0].shape[1])


def _first_launch_bytes(
    fast: GraphedCallable, inputs: dict[int, list[tuple[torch.Tensor]]], lengths: list[int], device: torch.device
) -> int:
    """Device memory taken by the first replay of each graph (a driver may defer work to the first launch)."""
    before = device_memory_in_use(device)
    for n in lengths:
        fast(*inputs[n][0])
    return max(device_memory_in_use(device) - before, 0)
