"""Case `graphs-memory`: device memory of one graph per shape, and what keeping it small costs per call.

Models (batch 1, fp16, random weights): GPT-2 124M forward with one graph per length 1..1024 (Grape's
setup; the quick run: 1..48), and a Wav2Vec2-base-sized encoder (12 layers, hidden 768) at audio
lengths spread over 1-16 s. Each is graphed three ways, one after the other in one process:

- (a) one `torch.cuda.graph` per length with its own pool (what a user of PyTorch's graphs gets),
  captured in order of length until free device memory falls to `RESERVE_BYTES`; the memory of the
  remaining lengths is extrapolated linearly from the bytes per graph measured over the last half of
  the captured lengths (reported in the notes and in `extra`);
- (b) one graph per length in one shared pool with a dedicated executable each: `tendril.graphed`
  without a budget (shared pool, outputs released to it, the dedicated strategy);
- (c) `tendril.graphed(..., memory=GraphMemoryPolicy(budget=BUDGET))`: the same graphs, executables made on demand under
  the budget by the automatic strategy (`update`: instantiated while the budget has room, then a miss switches
  the least recently used executable of the graph's topology family by `cudaGraphExecUpdate`, or evicts and
  instantiates where the family has none). When the last calls stepped the length by a constant amount the
  next length's executable is made ahead (instantiated or updated, and uploaded) on a background thread; its
  counts are reported as `latency_runs_prefetch_*` (all latency passes) and
  `latency_runs_{growing,random}_prefetch_*` (hits: calls that found their executable prefetched; waits: of
  those, calls that waited for it; wasted: prefetches evicted unused). `GRAPHS_MEMORY_STRATEGY=update` runs (c)
  under another `GraphMemoryPolicy.strategy` (default `auto`), `GRAPHS_MEMORY_PREFETCH=off` with
  `prefetch=False`.

Memory is the device memory in use (cudaMemGetInfo after emptying the allocator's cache) after
capturing all lengths, relative to before. Every length first runs once eagerly with the attention
kernels the graphs use, so the GPU code that CUDA loads lazily on first use (tens of MiB of kernel
modules) is loaded before any variant is measured and charged to none. `driver_mib_per_extra_graph`
is (c)'s device memory outside its pool and placeholders, from after its first graph to after all of
them, per extra graph.

Latency: per-call wall time with a synchronisation after every call (as a generation loop reading
its next token has), (c) against (b) (same dispatch, dedicated executables), in alternating passes:
lengths growing by one per call, and a random order of the lengths. The overhead is the median over
passes of total (c) time / total (b) time. Where it arises: `latency_overhead_{growing,random}_len_LOW-HIGH`
is the same ratio over one band of lengths (`length_bands`, from each length's median time over passes), and
`extra` holds each length's median time under (b) and (c) (`ms_per_call_by_length`).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from benchmarks.registry import Context, Goal, register
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS
from tendril.graphs.options import GraphMemoryPolicy
from tendril.utils.device_memory import device_memory_in_use

MIB = 1 << 20
VOCAB = 50257
SAMPLE_RATE = 16_000
BUDGET = "64MiB"
QUICK_BUDGET = "16MiB"
"""Budget of the quick run: its 48 GPT-2 graphs (about 40 MiB of executables) would all fit in `BUDGET`."""
QUICK_GPT2_LENGTHS = 48
"""The quick run's GPT-2 lengths are 1..48: consecutive, so its growing pass steps by one per call as the
full run's (and the latency target's) does; a spread over 1..1024 would step by 21-22 and test another loop."""
RESERVE_BYTES = 8 << 30
"""Free device memory left when capturing (a) stops."""
PASSES = 3
BANDS = 5
"""Bands of lengths the latency overhead is also reported for (`length_bands`): GPT-2's 1-64, 65-128, ..., 513-1024."""
PREFETCH_STATS = ("prefetches", "prefetch_hits", "prefetch_waits", "prefetch_wasted")
"""`GraphMemory` counters of prefetching (see `tendril.graphs.executables`)."""
SWITCH_STATS = ("instantiations", "updates", "update_failures", "evictions", "switch_ms", *PREFETCH_STATS)


# -- pure helpers (tested on the CPU) -----------------------------------------------------------------


def spread(low: int, high: int, count: int) -> list[int]:
    """`count` distinct integers spread evenly over [low, high], both ends included."""
    if count < 1 or high < low:
        raise ValueError(f"cannot spread {count} values over [{low}, {high}]")
    if count == 1:
        return [high]
    values = sorted({round(low + (high - low) * i / (count - 1)) for i in range(count)})
    return values


def extrapolate_linear(measured: dict[int, int], lengths: Sequence[int]) -> tuple[float, int]:
    """Total bytes of one graph per length in `lengths`: measured values where present, the others from a
    least-squares line of bytes against length fitted to the last half of the measured lengths.

    Returns the total and how many lengths were extrapolated."""
    missing = [n for n in lengths if n not in measured]
    total = float(sum(measured[n] for n in lengths if n in measured))
    if not missing:
        return total, 0
    points = sorted(measured.items())[len(measured) // 2 :]
    if len(points) < 2:
        raise ValueError("need at least 4 measured lengths to extrapolate")
    xs = [float(n) for n, _ in points]
    ys = [float(b) for _, b in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread_x = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread_x if spread_x else 0.0
    intercept = mean_y - slope * mean_x
    total += sum(max(intercept + slope * n, 0.0) for n in missing)
    return total, len(missing)


def overhead(candidate_ms: Sequence[Sequence[float]], reference_ms: Sequence[Sequence[float]]) -> float:
    """Median over passes of total candidate time / total reference time (passes paired in order)."""
    ratios = [sum(c) / sum(r) for c, r in zip(candidate_ms, reference_ms, strict=True)]
    return statistics.median(ratios)


def per_length_median(passes: Sequence[Sequence[float]], order: Sequence[int]) -> dict[int, float]:
    """Each length's median call time over passes that each called the lengths in `order`."""
    return {n: statistics.median(times[i] for times in passes) for i, n in enumerate(order)}


def length_bands(lengths: Sequence[int], count: int = BANDS) -> list[tuple[int, int]]:
    """Bands of lengths (inclusive bounds) ending at the longest / 2**(count - 1), ..., / 2, the longest: where
    a switch hides behind a short call or a long one. Empty bands are left out."""
    longest = max(lengths)
    ends = [longest >> shift for shift in range(count - 1, -1, -1)]
    bands, low = [], min(lengths)
    for end in ends:
        if any(low <= n <= end for n in lengths):
            bands.append((low, end))
        low = max(low, end + 1)
    return bands


def overhead_by_band(
    candidate: dict[int, float], reference: dict[int, float], bands: Sequence[tuple[int, int]]
) -> dict[str, float]:
    """Per band, named "low-high": total candidate time / total reference time over the band's lengths."""
    result = {}
    for low, high in bands:
        lengths = [n for n in candidate if low <= n <= high]
        if lengths:
            result[f"{low}-{high}"] = sum(candidate[n] for n in lengths) / sum(reference[n] for n in lengths)
    return result


def per_extra_graph(after_first: int, after_all: int, graphs: int) -> float:
    """Bytes per graph added after the first (0 when there is only one)."""
    return (after_all - after_first) / (graphs - 1) if graphs > 1 else 0.0


# -- models and variants ------------------------------------------------------------------------------


def _gpt2(device: torch.device) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(use_cache=False, n_positions=1024))
    return model.to(device=device, dtype=torch.float16).eval()


def _wav2vec2(device: torch.device) -> torch.nn.Module:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    return Wav2Vec2Model(Wav2Vec2Config()).to(device=device, dtype=torch.float16).eval()


def _outside_pool(fast: GraphedCallable, device: torch.device, base: int) -> int:
    return device_memory_in_use(device) - base - fast.stats.pool_bytes - fast.stats.placeholder_bytes


def _separate_pools(
    model: torch.nn.Module, examples: dict[int, torch.Tensor], device: torch.device
) -> tuple[dict[int, int], float]:
    """(a): a graph with its own pool per length, in order of length, until free memory runs low.
    Returns the bytes each captured length took and the capture time per graph (ms)."""
    measured: dict[int, int] = {}
    graphs: list[Any] = []
    start = time.perf_counter()
    used = _in_use(device)
    for n, placeholder in sorted(examples.items()):
        free, _ = torch.cuda.mem_get_info(device)
        if free < RESERVE_BYTES:
            break
        with sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                model(placeholder)
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model(placeholder)
        graphs.append((graph, out))
        now = _in_use(device)
        measured[n] = now - used
        used = now
    capture_ms = (time.perf_counter() - start) * 1e3 / max(len(measured), 1)
    del graphs
    return measured, capture_ms


def _in_use(device: torch.device) -> int:
    """Device memory in use after emptying the allocator's cache (without a garbage collection: fast enough
    to call after each of 1024 captures; the pools of live graphs stay)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def _tendril(
    model: torch.nn.Module,
    examples: dict[int, torch.Tensor],
    device: torch.device,
    budget: str | None,
    options: dict[str, Any] | None = None,
) -> tuple[GraphedCallable, int, int, float]:
    """(b) or (c): capture every length (largest first). Returns the callable, device bytes after all graphs,
    bytes outside pool and placeholders from after the first graph to after all, capture ms per graph."""
    base = device_memory_in_use(device)
    memory = GraphMemoryPolicy(budget=budget, **(options or {}))  # type: ignore[arg-type]  # "64MiB" is parsed
    fast = graphed(model, max_graphs=len(examples), memory=memory)
    order = sorted(examples, reverse=True)
    start = time.perf_counter()
    fast.capture([(examples[order[0]],)], progress=False)
    after_first = _outside_pool(fast, device, base)
    fast.capture([(examples[n],) for n in order[1:]], progress=False)
    torch.cuda.synchronize(device)
    capture_ms = (time.perf_counter() - start) * 1e3 / len(order)
    after_all = _outside_pool(fast, device, base)
    return fast, device_memory_in_use(device) - base, after_all - after_first, capture_ms


def _call_ms(fn: Callable[..., Any], sequence: Sequence[torch.Tensor], device: torch.device) -> list[float]:
    """Wall time of each call, synchronising after each (as a generation loop reading its next token)."""
    times = []
    torch.cuda.synchronize(device)
    for example in sequence:
        start = time.perf_counter()
        fn(example)
        torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _latency(
    budgeted: GraphedCallable,
    dedicated: GraphedCallable,
    sequence: Sequence[torch.Tensor],
    device: torch.device,
    passes: int,
) -> tuple[float, list[list[float]], list[list[float]]]:
    _call_ms(dedicated, sequence, device)  # warm: every graph replayed once
    _call_ms(budgeted, sequence, device)
    ours, theirs = [], []
    for _ in range(passes):
        theirs.append(_call_ms(dedicated, sequence, device))
        ours.append(_call_ms(budgeted, sequence, device))
    return overhead(ours, theirs), ours, theirs


def _load_kernels(model: torch.nn.Module, examples: dict[int, torch.Tensor]) -> None:
    """Run every length once eagerly, as the graphs will (attention backends included): CUDA loads kernel
    modules lazily, at first use, and that memory belongs to no variant."""
    with sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):
        for example in examples.values():
            model(example)


def _measure_model(
    ctx: Context,
    label: str,
    model: torch.nn.Module,
    examples: dict[int, torch.Tensor],
    passes: int,
    budget: str,
    options: dict[str, Any],
) -> dict[str, float]:
    device = ctx.device
    lengths = sorted(examples)
    with torch.inference_mode():
        _load_kernels(model, examples)
        budgeted, c_bytes, c_extra, c_capture_ms = _tendril(model, examples, device, budget, options)
        dedicated, b_bytes, b_extra, b_capture_ms = _tendril(model, examples, device, None)
        before = _switching(budgeted)
        growing, growing_ours, growing_theirs = _latency(
            budgeted, dedicated, [examples[n] for n in lengths], device, passes
        )
        between = _switching(budgeted)
        shuffled = list(lengths)
        random.Random(0).shuffle(shuffled)
        randomly, random_ours, random_theirs = _latency(
            budgeted, dedicated, [examples[n] for n in shuffled], device, passes
        )
        after = _switching(budgeted)
        got = budgeted(examples[lengths[len(lengths) // 2]])
        expected = dedicated(examples[lengths[len(lengths) // 2]])
        if not all(torch.equal(g, e) for g, e in zip(_tensors(got), _tensors(expected), strict=True)):
            ctx.note(f"{label}: budgeted and dedicated executables disagree (they must be identical)")
        records = list(budgeted.stats.graphs.values())
        families = {r.memory.family for r in records}
        nodes = [r.memory.nodes or 0 for r in records]
        hosts = [r.memory.host_bytes or 0 for r in records]
        cache = next(iter(budgeted._backend.executable_caches().values()))
        per_node = cache.accounting.bytes_per_node
        executables = {"alive": cache.executables, "charged": cache.live_bytes, "per_node": per_node}
        stats_line = budgeted.stats.table().splitlines()[0]
        del budgeted, dedicated, got, expected, cache
        device_memory_in_use(device)
        measured, a_capture_ms = _separate_pools(model, examples, device)
    a_bytes, extrapolated = extrapolate_linear(measured, lengths)
    if extrapolated:
        ctx.note(
            f"{label}: (a) one pool per length fit {len(measured)} of {len(lengths)} lengths (up to "
            f"{max(measured)}) before free memory fell to {RESERVE_BYTES >> 30} GiB; the other {extrapolated} "
            "are extrapolated linearly from the bytes per graph of the last half measured"
        )
    variant = {"a": f"{label} (a) pool per length", "b": f"{label} (b) shared pool", "c": f"{label} (c) tendril"}
    ctx.add_value(variant["a"], "device_MiB", a_bytes / MIB)
    ctx.add_value(variant["b"], "device_MiB", b_bytes / MIB)
    ctx.add_value(variant["c"], "device_MiB", c_bytes / MIB)
    ctx.add_value(variant["b"], "outside_pool_MiB_per_extra_graph", per_extra_graph(0, b_extra, len(lengths)) / MIB)
    ctx.add_value(variant["c"], "outside_pool_MiB_per_extra_graph", per_extra_graph(0, c_extra, len(lengths)) / MIB)
    ctx.add_value(variant["a"], "capture_ms_per_graph", a_capture_ms)
    ctx.add_value(variant["b"], "capture_ms_per_graph", b_capture_ms)
    ctx.add_value(variant["c"], "capture_ms_per_graph", c_capture_ms)
    ctx.add_value(variant["c"], "executables_alive", executables["alive"])
    ctx.add_value(variant["c"], "executables_charged_MiB", executables["charged"] / MIB)
    ctx.add_value(variant["c"], "driver_bytes_per_node_learnt", executables["per_node"])
    ctx.add_value(variant["c"], "topology_families", len(families))
    ctx.add_value(variant["c"], "nodes_per_graph_median", statistics.median(nodes))
    ctx.add_value(variant["c"], "host_MiB_per_graph_median", statistics.median(hosts) / MIB)
    by_length: dict[str, dict[str, dict[str, float]]] = {}
    for name, order, ours, theirs in (
        ("growing", lengths, growing_ours, growing_theirs),
        ("random", shuffled, random_ours, random_theirs),
    ):
        ctx.add_value(variant["c"], f"ms_per_call_{name}_median", statistics.median(x for p in ours for x in p))
        ctx.add_value(variant["b"], f"ms_per_call_{name}_median", statistics.median(x for p in theirs for x in p))
        c_ms, b_ms = per_length_median(ours, order), per_length_median(theirs, order)
        for band, ratio in overhead_by_band(c_ms, b_ms, length_bands(lengths)).items():
            ctx.add_value(variant["c"], f"latency_overhead_{name}_len_{band}", ratio)
        by_length[name] = {v: {str(n): ms[n] for n in lengths} for v, ms in (("b", b_ms), ("c", c_ms))}
    for what in SWITCH_STATS:
        ctx.add_value(variant["c"], f"latency_runs_{what}", after[what] - before[what])
    for what in PREFETCH_STATS:
        ctx.add_value(variant["c"], f"latency_runs_growing_{what}", between[what] - before[what])
        ctx.add_value(variant["c"], f"latency_runs_random_{what}", after[what] - between[what])
    growing_calls = len(lengths) * (passes + 1)
    ctx.note(
        f"{label} (c) prefetching over {growing_calls} growing calls (warm-up pass included): "
        f"{between['prefetch_hits'] - before['prefetch_hits']:.0f} found their executable prefetched, "
        f"{between['prefetch_waits'] - before['prefetch_waits']:.0f} of them waited for it, "
        f"{between['prefetch_wasted'] - before['prefetch_wasted']:.0f} prefetches wasted; random order: "
        f"{after['prefetches'] - between['prefetches']:.0f} prefetches, "
        f"{after['prefetch_hits'] - between['prefetch_hits']:.0f} hits"
    )
    ctx.extra[label] = {
        "separate_pool_bytes_measured": {str(n): b for n, b in measured.items()},
        "tendril_stats": stats_line,
        "families": sorted(f for f in families if f),
        "ms_per_call_by_length": by_length,
    }
    return {
        "a": a_bytes,
        "c": c_bytes,
        "c_extra_per_graph": per_extra_graph(0, c_extra, len(lengths)),
        "growing": growing,
        "random": randomly,
    }


def _options() -> dict[str, Any]:
    """(c)'s `GraphMemoryPolicy` fields besides the budget: `strategy` from GRAPHS_MEMORY_STRATEGY (default "auto"),
    and GRAPHS_MEMORY_PREFETCH=off for `prefetch=False` (default: True)."""
    options: dict[str, Any] = {"strategy": os.environ.get("GRAPHS_MEMORY_STRATEGY", "auto")}
    prefetch = os.environ.get("GRAPHS_MEMORY_PREFETCH", "")
    if prefetch not in ("", "off"):
        raise ValueError(f"GRAPHS_MEMORY_PREFETCH={prefetch!r}: expected off")
    if prefetch:
        options["prefetch"] = False
    return options


def _switching(fast: GraphedCallable) -> dict[str, float]:
    memory = [r.memory for r in fast.stats.graphs.values()]
    return {what: sum(getattr(m, what) for m in memory) for what in SWITCH_STATS}


def _tensors(tree: Any) -> list[torch.Tensor]:
    from torch.utils import _pytree as pytree

    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


@register("graphs-memory", "device memory of one graph per length (GPT-2 1..1024, Wav2Vec2-base) and switching cost")
def run(ctx: Context) -> None:
    device = ctx.device
    torch.manual_seed(0)
    passes = 1 if ctx.quick else PASSES
    gpt2_lengths = list(range(1, QUICK_GPT2_LENGTHS + 1) if ctx.quick else range(1, 1025))
    model = _gpt2(device)
    ids = {n: torch.randint(0, VOCAB, (1, n), device=device) for n in gpt2_lengths}
    budget = QUICK_BUDGET if ctx.quick else BUDGET
    options = _options()
    gpt2 = _measure_model(ctx, "GPT-2", model, ids, passes, budget, options)
    del model, ids
    device_memory_in_use(device)

    seconds = spread(1 * SAMPLE_RATE, 16 * SAMPLE_RATE, 12 if ctx.quick else 64)
    encoder = _wav2vec2(device)
    audio = {n: torch.randn(1, n, device=device, dtype=torch.float16) for n in seconds}
    wav = _measure_model(ctx, "Wav2Vec2-base", encoder, audio, passes, budget, options)
    ctx.add_value("Wav2Vec2-base", "memory_ratio_vs_separate_pools", wav["a"] / wav["c"])
    ctx.add_value("Wav2Vec2-base", "latency_overhead_random_len", wav["random"])

    settings = "".join(f", {name}={value!r}" for name, value in options.items())
    ctx.note(f"(c) is tendril.graphed(model, memory=GraphMemoryPolicy(budget={budget!r}{settings}))")
    ctx.note("latency: wall time per call with a synchronisation after each call; (b) is tendril without a budget")
    ctx.target("memory_ratio_vs_separate_pools", gpt2["a"] / gpt2["c"], Goal(">=", 36.43))
    ctx.target("driver_mib_per_extra_graph", gpt2["c_extra_per_graph"] / MIB, Goal("<=", 0.1))
    ctx.target("latency_overhead_growing_len", gpt2["growing"], Goal("<=", 1.05))
    ctx.target("latency_overhead_random_len", gpt2["random"], Goal("<=", 1.15))
