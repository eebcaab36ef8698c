"""Case `graphs-vs-compile`: `tendril.graphed` beside `torch.compile`'s CUDA-graph trees, and the two together.

GPT-2 fp16, batch 1, 46 distinct lengths in 1..256 called in a random order (144 timed calls). Four variants in one
process, made and warmed up one after another in this order, then all timed together:

- `torch.compile(model, mode="reduce-overhead", dynamic=True)`: Inductor's kernels in its CUDA-graph trees, with
  a cold Inductor cache of its own (`fresh_inductor_cache`). First, so that its warm-up is a fresh process's: it
  starts Inductor's compile workers, which the tendril variants after it find running;
- `tendril.graphed(model)`: tendril's shape-keyed graphs of the eager model;
- `tendril.graphed(model, compile=True)`: Inductor's kernels (its cudagraphs off) captured into tendril's graphs,
  with a cold cache under a fresh tendril cache dir;
- beside them, not in the targets: the same `compile=True` callable with every length captured ahead of time,
  largest first (`capture`, Inductor's caches warm from the variant before). Growing lengths make the shared pool
  grow by a segment each time a longer capture needs more than its free blocks hold; largest first reuses the
  first segment, so the two memories show how much of the pool that growth costs;
- beside them too: `compile=True` with `CudaBackend()`, Inductor's code traced with the attention kernels plain
  graphs are captured with (cuDNN attention left out) instead of PyTorch's own choice (cuDNN attention on the H200),
  which a compiled callable's default backend keeps. Its per-call time shows what leaving cuDNN attention out costs;
  what it saves, a host plan per new length, shows in a fresh process (the warm start), not here, where the
  torch.compile variant has planned every length already.

Warm-up: wall time from making the variant until every length has been called three times (enough for the CUDA-graph
trees to record and replay each length; tendril captures at the first). Per call: CUDA-event medians over the
144-call random order, the variants taking turns at each call (`time_interleaved`), so that no variant is timed in
a quieter or busier part of the run than another. Memory: graph memory after warm-up, the segments of the CUDA-graph
pools the variant made (tendril's input placeholders, outside its pool, added): what each system holds for its
graphs, the same whichever variant comes first. Device memory in use after warm-up, over what was in use before the
variant was made, is reported too, but it is not a fair comparison within one process: the first variant also pays
one-time costs (kernel modules, library workspaces) that later ones find paid, and memory a variant frees can be
reused by the next. Warm start: a second process (`python -m benchmarks.cases.graphs_vs_compile warm-start ...`)
given the first process's tendril cache dir times `tendril.graphed(model, compile=True)` from its creation until
all 46 lengths are ready (called once, graphs captured); the median of `WARM_STARTS` such processes, run one after
another, each report kept in `extra.second_process`. Every second process also has Python's bytecode cache, as an
installed environment does (pip compiles it at install): the processes share one under the tendril cache dir
(`PYTHONPYCACHEPREFIX`), which a first one, left out of the median, writes (`extra.bytecode_priming_process`; its time:
`second_process_without_bytecode_cache_ready_s`; `PYTHONDONTWRITEBYTECODE` is unset for them). Without it, a host
whose site-packages hold no bytecode and whose environment says not to write any (the GPU lane's) compiles every module
a process imports from source in every process, the modules the compile imports included. Whether
torch.compile recorded CUDA graphs at all is kept in `extra.torch_compile_cudagraph_skips` (Inductor skips them for
some graphs and then runs its kernels unrecorded).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import cudagraph_skips
from benchmarks.registry import Context, Goal, register
from tendril.config import Config
from tendril.graphs.callable import graphed
from tendril.graphs.cuda_backend import CudaBackend
from tendril.utils.device_memory import device_memory_in_use
from tendril.utils.timing import summarize, time_interleaved

MIB = 1 << 20
WARMUP_CALLS_PER_LENGTH = 3
WARM_STARTS = 3
"""Second processes timed one after another: the host's own time (dynamo tracing, loading kernels) varies by
seconds between them, so the target is their median."""
SECOND_PROCESS_UNSET = ("TORCHINDUCTOR_CACHE_DIR", "PYTHONDONTWRITEBYTECODE")
"""Left out of a second process's environment: Inductor's caches go under the tendril cache dir, and Python writes
the bytecode cache the processes share."""
COMPILE = "torch.compile reduce-overhead dynamic=True"
PLAIN = "tendril.graphed"
BOTH = "tendril.graphed compile=True"
AHEAD = "tendril.graphed compile=True, captured largest first"
RESTRICTED = "tendril.graphed compile=True, capture attention (no cuDNN)"


def draw_lengths(count: int, top: int, calls: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """`count` distinct lengths in 1..top, and a random order of `calls` calls over them using each at least once."""
    if count > top or calls < count:
        raise ValueError(f"cannot draw {count} distinct lengths in 1..{top} into {calls} calls")
    rng = random.Random(seed)
    lengths = sorted(rng.sample(range(1, top + 1), count))
    order = lengths + [rng.choice(lengths) for _ in range(calls - count)]
    rng.shuffle(order)
    return lengths, order


def sizes(quick: bool) -> tuple[int, int, int]:
    """(distinct lengths, longest length, timed calls)."""
    return (6, 64, 18) if quick else (46, 256, 144)


def gpt2(device: torch.device, quick: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(use_cache=False)
    if quick:
        config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=256, use_cache=False,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
    return GPT2LMHeadModel(config).to(device=device, dtype=torch.float16).eval()


def ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else float("inf")


def _logits(fn: Callable[..., Any]) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: fn(ids).logits


def _warm_up(fn: Callable[[torch.Tensor], torch.Tensor], inputs: dict[int, torch.Tensor], device: torch.device) -> None:
    for _ in range(WARMUP_CALLS_PER_LENGTH):
        for ids in inputs.values():
            fn(ids)
    torch.cuda.synchronize(device)


def _prepare(
    ctx: Context, name: str, make: Callable[[], Any], model: torch.nn.Module, inputs: dict[int, torch.Tensor]
) -> dict[str, Any]:
    """Make one variant and warm it up on every length; record its warm-up time, its memory after warm-up (device
    memory over what was in use before, and the segments of the CUDA-graph pools it made) and its largest error
    against eager; return the variant, its logits function and those numbers."""
    device = ctx.device
    base = device_memory_in_use(device)
    pools_before = pool_ids()
    start = time.perf_counter()
    variant = make()
    fn = _logits(variant)
    _warm_up(fn, inputs, device)
    warmup_s = time.perf_counter() - start
    memory = device_memory_in_use(device) - base
    segments = pool_segments_mib(exclude=pools_before)
    placeholders = getattr(getattr(variant, "stats", None), "placeholder_bytes", 0)
    graph_memory = sum(reserved for reserved, _ in segments) * MIB + placeholders
    errors = [(fn(ids).float() - model(ids).logits.float()).abs().max().item() for ids in inputs.values()]
    ctx.extra[f"{name} pool segments MiB"] = segments
    ctx.add_value(name, "warmup_s_all_lengths", warmup_s)
    ctx.add_value(name, "device_MiB_after_warmup", memory / MIB)
    ctx.add_value(name, "graph_MiB_after_warmup", graph_memory / MIB)
    ctx.add_value(name, "max_abs_logits_error_vs_eager", max(errors))
    return {"variant": variant, "fn": fn, "warmup_s": warmup_s, "memory": memory, "graph_memory": graph_memory}


def capture_phases_ms(stats: Any) -> dict[str, float]:
    """Host milliseconds of each capture phase (warm-up run, record, instantiate), summed over a callable's graphs:
    where its warm-up went."""
    totals: dict[str, float] = {}
    for record in stats.graphs.values():
        for phase, ms in record.phases_ms.items():
            totals[phase] = totals.get(phase, 0.0) + ms
    return totals


def pool_ids(snapshot: list[dict[str, Any]] | None = None) -> set[tuple[int, int]]:
    """The ids of the CUDA-graph memory pools that hold segments now (the allocator's own pool, (0, 0), left out).
    `snapshot`: `torch.cuda.memory_snapshot()`."""
    segments = torch.cuda.memory_snapshot() if snapshot is None else snapshot
    return {tuple(s.get("segment_pool_id", (0, 0))) for s in segments} - {(0, 0)}


def pool_segments_mib(
    snapshot: list[dict[str, Any]] | None = None, exclude: set[tuple[int, int]] = frozenset()
) -> list[tuple[float, float]]:
    """The segments of the CUDA-graph memory pools other than `exclude` (and the allocator's own pool, id (0, 0)),
    largest first, as (reserved, allocated) MiB: how a variant's graph memory is split, so that a pool grown by
    blocks too small for later, longer lengths shows as several large segments. `snapshot`:
    `torch.cuda.memory_snapshot()`."""
    segments = torch.cuda.memory_snapshot() if snapshot is None else snapshot
    left_out = {(0, 0), *exclude}
    pooled = [s for s in segments if tuple(s.get("segment_pool_id", (0, 0))) not in left_out]
    sizes = [(round(s["total_size"] / MIB, 2), round(s["allocated_size"] / MIB, 2)) for s in pooled]
    return sorted(sizes, reverse=True)


def memory_mib(stats: Any) -> dict[str, float]:
    """Where a tendril variant's device memory went, in MiB: its graphs' shared pool, the placeholders its
    inputs are copied into, and the driver's memory for the instantiated graphs."""
    return {
        "pool": stats.pool_bytes / MIB,
        "placeholders": stats.placeholder_bytes / MIB,
        "driver": stats.driver_bytes / MIB,
    }


@register("graphs-vs-compile", "GPT-2 fp16 at 46 random lengths: tendril.graphed vs torch.compile vs both together")
def run(ctx: Context) -> None:
    from torch._inductor.utils import fresh_inductor_cache

    device = ctx.device
    count, top, calls = sizes(ctx.quick)
    lengths, order = draw_lengths(count, top, calls)
    model = gpt2(device, ctx.quick)
    vocab = model.config.vocab_size
    cache_dir = Path(tempfile.mkdtemp(prefix="tendril-graphs-vs-compile-"))
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)  # Inductor's caches go under the fresh tendril cache dir
    with torch.inference_mode():
        inputs = {n: torch.randint(0, vocab, (1, n), device=device) for n in lengths}
        model(inputs[lengths[-1]])
        with fresh_inductor_cache(), cudagraph_skips.watch() as skips:
            compiled = _prepare(
                ctx, COMPILE, lambda: torch.compile(model, mode="reduce-overhead", dynamic=True), model, inputs
            )
        ctx.extra["torch_compile_cudagraph_skips"] = skips
        if skips["skips"]:
            ctx.note(f"torch.compile skipped CUDA graphs {skips['skips']} time(s): {'; '.join(skips['reasons'])}")
        plain = _prepare(ctx, PLAIN, lambda: graphed(model, max_graphs=count), model, inputs)
        ctx.extra["tendril_capture_phases_ms"] = capture_phases_ms(plain["variant"].stats)
        ctx.extra["tendril_memory_mib"] = memory_mib(plain["variant"].stats)

        def compiled_graphed() -> Any:
            return graphed(model, max_graphs=count, compile=True, config=Config(cache_dir=cache_dir))

        both = _prepare(ctx, BOTH, compiled_graphed, model, inputs)
        compile_stats = both["variant"].stats.compile
        ctx.extra["compile_stats"] = repr(compile_stats)
        ctx.extra["tendril_compile_memory_mib"] = memory_mib(both["variant"].stats)
        ctx.extra["tendril_compile_capture_phases_ms"] = capture_phases_ms(both["variant"].stats)
        ctx.add_value(BOTH, "recompiles_after_first_call", compile_stats.recompiles)
        ctx.extra["first_process_cache_files"] = sum(path.is_file() for path in cache_dir.rglob("*"))

        def captured_ahead() -> Any:
            fast = compiled_graphed()
            fast.capture(list(inputs.values()), progress=False)
            return fast

        ahead = _prepare(ctx, AHEAD, captured_ahead, model, inputs)
        ctx.extra["tendril_compile_ahead_memory_mib"] = memory_mib(ahead["variant"].stats)

        def capture_attention() -> Any:
            config = Config(cache_dir=Path(tempfile.mkdtemp(prefix="tendril-capture-attention-")))
            return graphed(model, max_graphs=count, compile=True, backend=CudaBackend(), config=config)

        restricted = _prepare(ctx, RESTRICTED, capture_attention, model, inputs)
        prepared = {COMPILE: compiled, PLAIN: plain, BOTH: both, AHEAD: ahead, RESTRICTED: restricted}
        timings = time_interleaved(
            {name: measured["fn"] for name, measured in prepared.items()},
            [(inputs[n],) for n in order],
            device=device,
        )
    for name, timing in timings.items():
        ctx.add_timing(name, timing)
        measured = prepared[name]
        ctx.note(f"{name}: warm-up {measured['warmup_s']:.1f} s, {timing.median_ms:.3f} ms per call, "
                 f"{measured['graph_memory'] / MIB:.0f} MiB of graph memory, "
                 f"{measured['memory'] / MIB:.0f} MiB of device memory")  # fmt: skip
    ctx.note(f"{count} lengths in 1..{top}, {calls} timed calls in a random order; GPT-2 fp16 batch 1")
    for measured in prepared.values():
        del measured["variant"], measured["fn"]
    torch._dynamo.reset()
    priming = _warm_start(cache_dir, ctx.quick)
    ctx.add_value(BOTH, "second_process_without_bytecode_cache_ready_s", priming["ready_s"])
    ctx.extra["bytecode_priming_process"] = priming
    warm_starts = [_warm_start(cache_dir, ctx.quick) for _ in range(WARM_STARTS)]
    ready = summarize([report["ready_s"] for report in warm_starts])  # seconds: the statistics ignore the unit
    warm_start_s = ready.median_ms
    ctx.add_timing(BOTH, ready, "second_process_ready_s")
    ctx.extra["second_process"] = warm_starts
    ctx.extra["lengths"] = lengths
    ctx.extra["tendril_cache_dir"] = str(cache_dir)
    per_call = ratio(timings[BOTH].median_ms, timings[COMPILE].median_ms)
    ctx.target("compiled_graphed_over_compile_per_call", per_call, Goal("<=", 1.0))
    ctx.target("graphed_warmup_over_compile_warmup", ratio(plain["warmup_s"], compiled["warmup_s"]), Goal("<=", 0.05))
    ctx.target("compiled_graphed_warm_start_s", warm_start_s, Goal("<=", 10))
    memory = ratio(both["graph_memory"], compiled["graph_memory"])
    ctx.target("compiled_graphed_memory_over_compile", memory, Goal("<=", 1.0))


def _warm_start(cache_dir: Path, quick: bool) -> dict[str, Any]:
    """What a second process, given `cache_dir` (and Python's bytecode cache under it), reports (`warm_start_main`):
    `ready_s`, the seconds from `graphed(model, compile=True)` to all lengths ready, with its compile time, cache hits
    and misses, and where the compile's time went (`compile_phases_s`: seconds per phase of dynamo's, AOTAutograd's
    and Inductor's timed functions, summed over calls; nested phases overlap) and the captures'
    (`capture_phases_ms`)."""
    root = Path(__file__).resolve().parents[2]
    env = {key: value for key, value in os.environ.items() if key not in SECOND_PROCESS_UNSET}
    env["TENDRIL_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPYCACHEPREFIX"] = str(cache_dir / "pycache")
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "src"), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "benchmarks.cases.graphs_vs_compile", "warm-start", *(["--quick"] * quick)]
    done = subprocess.run(command, env=env, cwd=root, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the warm-start process failed ({done.returncode}):\n{done.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def warm_start_main(quick: bool) -> None:
    """The second process: the same model and lengths, the cache dir from TENDRIL_CACHE_DIR; prints {"ready_s": ...}."""
    device = torch.device("cuda")
    count, top, calls = sizes(quick)
    lengths, _ = draw_lengths(count, top, calls)
    model = gpt2(device, quick)
    with torch.inference_mode():
        inputs = [torch.randint(0, model.config.vocab_size, (1, n), device=device) for n in lengths]
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        fast = graphed(model, max_graphs=count, compile=True)
        for ids in inputs:
            fast(ids)
        torch.cuda.synchronize(device)
        ready_s = time.perf_counter() - start
    from torch._dynamo.utils import compilation_time_metrics, counters

    stats = fast.stats.compile
    caches = {f"{group} {name}": count for group in ("inductor", "aot_autograd")
              for name, count in counters[group].items() if "cache" in name}  # fmt: skip
    phases = {name: round(sum(times), 3) for name, times in compilation_time_metrics.items()}
    print(json.dumps({
        "ready_s": ready_s, "compile_s": stats.compile_s if stats else None,
        "compiles": stats.compiles if stats else None, "graphs": len(fast.keys()), "caches": caches,
        "capture_phases_ms": capture_phases_ms(fast.stats),
        "compile_phases_s": dict(sorted(phases.items(), key=lambda item: -item[1])),
    }))  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:2] != ["warm-start"]:
        raise SystemExit("usage: python -m benchmarks.cases.graphs_vs_compile warm-start [--quick]")
    warm_start_main("--quick" in sys.argv[2:])
