"""What switching executables costs per call on the GPU (a diagnostic behind the `graphs-memory` case).

GPT-2 fp16 (random weights) graphed at lengths 1..N three ways: dedicated executables, one executable per
topology family switched by `cudaGraphExecUpdate` (`graph_memory_strategy="update"` without a budget or
prefetching: before 5fc3764 it ran with a 1 GiB budget, under which `update` now never switches), and executables made
on demand with a budget that holds them all (`"lru"`, so nothing is switched after the first pass).
Per-call wall time with a synchronisation after each call, lengths growing by one per call. Then a
Wav2Vec2-base encoder under a 16 MiB budget with each strategy, in a subprocess each (an illegal
instruction ends a CUDA context), every call checked against dedicated executables, and the child-graph
nodes its graphs hold counted (cuDNN captures its work as child graphs).

    PYTHONPATH=src:. python3 -m benchmarks.tools.graph_switch_cost --out $OUT [--lengths 96]
        [--wav2vec2-only --wav2vec2-lengths 64 --budget 64MiB --strategies auto] [--launch-blocking]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import graphs_memory as case
from tendril.graphs.callable import graphed

STRATEGIES = {
    "dedicated": {},
    "update": {"graph_memory_strategy": "update", "graph_memory_prefetch": False},  # no budget: one per family
    "lru": {"graph_memory_budget": "1GiB", "graph_memory_strategy": "lru"},
}

WAV2VEC2_CHECK = """
import collections, random, sys, torch
from benchmarks.cases import graphs_memory as case
from tendril.graphs.callable import graphed
device = torch.device("cuda")
encoder = case._wav2vec2(device)
strategy, count, budget = sys.argv[1], int(sys.argv[2]), sys.argv[3]
lengths = case.spread(case.SAMPLE_RATE, 16 * case.SAMPLE_RATE, count)
audio = {n: torch.randn(1, n, device=device, dtype=torch.float16) for n in lengths}
with torch.inference_mode():
    case._load_kernels(encoder, audio)
    budgeted = graphed(encoder, max_graphs=len(lengths), graph_memory_budget=budget, graph_memory_strategy=strategy)
    budgeted.capture([(audio[n],) for n in sorted(lengths, reverse=True)], progress=False)
    from cuda.bindings import runtime
    (cache,) = budgeted._backend.executable_caches().values()
    kinds = collections.Counter()
    for source in cache._sources.values():
        handle = runtime.cudaGraph_t(init_value=source.graph.raw_cuda_graph())
        count = runtime.cudaGraphGetNodes(handle, 0)[-1]
        nodes = runtime.cudaGraphGetNodes(handle, count)[1]
        kinds.update(runtime.cudaGraphNodeGetType(node)[1].name for node in list(nodes)[:count])
    print("node kinds over all graphs:", dict(kinds), flush=True)
    dedicated = graphed(encoder, max_graphs=len(lengths))
    for i, n in enumerate(lengths + random.Random(0).sample(lengths, len(lengths))):
        switched = sum(r.memory.updates + r.memory.instantiations for r in budgeted.stats.graphs.values())
        got = budgeted(audio[n]).last_hidden_state
        torch.cuda.synchronize()
        after = sum(r.memory.updates + r.memory.instantiations for r in budgeted.stats.graphs.values())
        print(f"call {i} length {n}: switches {after - switched}", flush=True)
        assert torch.equal(got, dedicated(audio[n]).last_hidden_state), n
    memory = [r.memory for r in budgeted.stats.graphs.values()]
    print(f"{strategy}: equal to dedicated; families {len({m.family for m in memory})}, "
          f"updates {sum(m.updates for m in memory)}, instantiations {sum(m.instantiations for m in memory)}")
"""


def per_call_ms(fn: Callable[[torch.Tensor], Any], sequence: Sequence[torch.Tensor]) -> list[float]:
    times = []
    torch.cuda.synchronize()
    for example in sequence:
        start = time.perf_counter()
        fn(example)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def gpt2_switching(count: int) -> dict[str, Any]:
    device = torch.device("cuda")
    model = case._gpt2(device)
    torch.manual_seed(0)
    lengths = list(range(1, count + 1))
    ids = {n: torch.randint(0, case.VOCAB, (1, n), device=device) for n in lengths}
    times: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    with torch.inference_mode():
        case._load_kernels(model, ids)
        callables = {}
        for name, options in STRATEGIES.items():
            callables[name] = graphed(model, max_graphs=count, **options)
            callables[name].capture([(ids[n],) for n in sorted(lengths, reverse=True)], progress=False)
        sequence = [ids[n] for n in lengths]
        for fast in callables.values():
            per_call_ms(fast, sequence)
        for _ in range(3):
            for name, fast in callables.items():
                times[name].extend(per_call_ms(fast, sequence))
    result: dict[str, Any] = {f"{name}_ms_per_call_median": statistics.median(t) for name, t in times.items()}
    for name in ("update", "lru"):
        memory = [r.memory for r in callables[name].stats.graphs.values()]
        result[f"{name}_families"] = len({m.family for m in memory})
        result[f"{name}_updates"] = sum(m.updates for m in memory)
        result[f"{name}_instantiations"] = sum(m.instantiations for m in memory)
        result[f"{name}_switch_ms_total"] = sum(m.switch_ms for m in memory)
    return result


def wav2vec2_strategy(strategy: str, count: int, budget: str, launch_blocking: bool) -> dict[str, Any]:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1" if launch_blocking else "0")
    command = [sys.executable, "-c", WAV2VEC2_CHECK, strategy, str(count), budget]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    tails = {"stdout": done.stdout[-2000:], "stderr": done.stderr[-2000:]}
    return {"strategy": strategy, "returncode": done.returncode, **tails}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, default=96, help="GPT-2 lengths 1..N")
    parser.add_argument("--wav2vec2-only", action="store_true")
    parser.add_argument("--wav2vec2-lengths", type=int, default=24)
    parser.add_argument("--budget", default="16MiB", help="graph_memory_budget of the Wav2Vec2 runs")
    parser.add_argument("--strategies", default="lru,update,auto")
    parser.add_argument("--launch-blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1 for Wav2Vec2")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    options = {name: str(value) for name, value in vars(args).items()}
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": options}
    if not args.wav2vec2_only:
        results["gpt2"] = gpt2_switching(args.lengths)
        print(json.dumps(results["gpt2"]), flush=True)
    results["wav2vec2"] = [
        wav2vec2_strategy(s, args.wav2vec2_lengths, args.budget, args.launch_blocking)
        for s in args.strategies.split(",")
    ]
    (args.out / "graph-switch-cost.json").write_text(json.dumps(results, indent=1))
    for run in results["wav2vec2"]:
        print(run["strategy"], "returncode", run["returncode"], run["stdout"].strip(), run["stderr"][-600:], flush=True)


if __name__ == "__main__":
    main()
