"""Where a budgeted cache's device memory goes, and what a switching call costs the host (a diagnostic behind
`graphs-memory`).

GPT-2 fp16 forward graphs at lengths 1..N, captured as `graphs-memory` captures (c) (`tendril.graphed` with a
`--budget`, largest length first) and (b) (no budget: dedicated executables). Reported:

- the cache after capture: executables alive, their charges, the learnt driver bytes per node, and the device memory
  outside the pool and placeholders that capturing all lengths added (`graphs-memory`'s `driver_mib_per_extra_graph`
  comes from it);
- what destroying every executable gives back to cudaMemGetInfo, then the growth when 64 executables of middle
  lengths are instantiated, uploaded, destroyed and instantiated again, and after a churn through every length
  keeping the cache's number alive (does the driver return executable memory, or keep it for later executables?);
- per call in random order: the host time until the call returns (before the synchronisation) and the whole call,
  for (b) and (c), and under (c) the host time of `ExecutableCache.launch` (acquire and the switch at launch) and
  of `prefetch_next`.

    PYTHONPATH=src:. python3 -m benchmarks.tools.executable_footprint --out OUT [--lengths 1024] [--budget 64MiB]

Writes OUT/executable_footprint.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import graphs_memory as case
from benchmarks.results import machine
from benchmarks.tools.switching_floor import Executable, drop, make
from tendril.cuda import graph_exec

MIB = 1 << 20
PASSES = 2
SAMPLE = 64


def free_bytes() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def timed(cache: Any, method: str, spent: list[float]) -> None:
    """Wrap `cache.<method>` so that each call's host time (ms) is appended to `spent`."""
    real = getattr(cache, method)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent.append((time.perf_counter() - start) * 1e3)

    setattr(cache, method, wrapper)


def random_calls(fn: Callable[..., Any], inputs: dict[int, torch.Tensor], order: list[int]) -> dict[str, float]:
    host, whole = [], []
    for n in order:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn(inputs[n])
        returned = time.perf_counter()
        torch.cuda.synchronize()
        host.append((returned - start) * 1e3)
        whole.append((time.perf_counter() - start) * 1e3)
    return {"host_ms_median": statistics.median(host), "call_ms_total": sum(whole)}


def driver_memory(segments: list[tuple[int, ...]], everything: list[tuple[int, ...]], alive: int) -> dict[str, float]:
    """Device memory (cudaMemGetInfo) per executable as executables come and go."""
    stream = torch.cuda.current_stream().cuda_stream
    before = free_bytes()
    made = [make(s) for s in segments]
    instantiated = free_bytes()
    for executable in made:
        for handle in executable:
            graph_exec.upload(handle, stream)
    uploaded = free_bytes()
    for executable in made:
        drop(executable)
    destroyed = free_bytes()
    made = [make(s) for s in segments]
    again = free_bytes()
    for executable in made:
        drop(executable)
    live: list[Executable] = []
    churn_start = free_bytes()
    for graph in everything:
        live.append(make(graph))
        if len(live) > alive:
            drop(live.pop(0))
    churned = free_bytes()
    for executable in live:
        drop(executable)
    count = len(segments)
    return {
        "instantiate_MiB_per_executable": (before - instantiated) / MIB / count,
        "upload_MiB_per_executable": (instantiated - uploaded) / MIB / count,
        "destroy_returned_MiB_per_executable": (destroyed - uploaded) / MIB / count,
        "instantiate_again_MiB_per_executable": (destroyed - again) / MIB / count,
        f"churn_through_all_keeping_{alive}_MiB": (churn_start - churned) / MIB,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, default=1024)
    parser.add_argument("--budget", default=case.BUDGET)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = case._gpt2(device)
    inputs = {n: torch.randint(0, case.VOCAB, (1, n), device=device) for n in range(1, args.lengths + 1)}
    order = list(inputs)
    random.Random(0).shuffle(order)
    result: dict[str, Any] = {
        "command": f"python -m benchmarks.tools.executable_footprint --out {args.out} --lengths {args.lengths} "
        f"--budget {args.budget}",
        **machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with torch.inference_mode():
        case._load_kernels(model, inputs)
        budgeted, _, outside_pool, _ = case._tendril(model, inputs, device, args.budget)
        cache = next(iter(budgeted._backend.executable_caches().values()))
        alive = cache.executables
        result["cache"] = {
            "executables_alive": alive,
            "charged_MiB": cache.live_bytes / MIB,
            "driver_bytes_per_node_learnt": cache.bytes_per_node,
            "outside_pool_growth_MiB": outside_pool / MIB,
        }
        dedicated, *_ = case._tendril(model, inputs, device, None)
        spent: dict[str, list[float]] = {"launch": [], "prefetch_next": []}
        for method, times in spent.items():
            timed(cache, method, times)
        calls: dict[str, list[dict[str, float]]] = {"b": [], "c": []}
        for index in range(PASSES + 1):  # the first pass warms up
            for times in spent.values():
                times.clear()
            for label, fn in (("b", dedicated), ("c", budgeted)):
                measured = random_calls(fn, inputs, order)
                if index:
                    calls[label].append(measured)
            if index:
                calls["c"][-1].update({f"{m}_host_ms_median": statistics.median(t) for m, t in spent.items() if t})
        result["random_calls"] = calls
        result["ratio_random"] = statistics.median(
            c["call_ms_total"] / b["call_ms_total"] for b, c in zip(calls["b"], calls["c"], strict=True)
        )
        sources = [cache._sources[key].graph.segments for key in cache._sources]
        before = free_bytes()
        cache.close()
        result["close_returned_MiB_per_executable"] = (free_bytes() - before) / MIB / alive
        middle = len(sources) // 4
        result["driver_memory"] = driver_memory(sources[middle : middle + SAMPLE], sources, alive)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "executable_footprint.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
