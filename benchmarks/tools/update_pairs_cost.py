"""What one switch by `cudaGraphExecUpdate` costs, host and GPU, when the kernel functions change and when they do not.

A diagnostic behind `graphs-memory`'s latency targets. Topology families ignore which kernel functions cuBLAS picked
(`graph_exec.Topology`), so an update within a family may swap functions. Two questions decide how a cache should
pick the executable it updates:

- does the update's host time depend on how many kernel nodes change function (a switching call in random order
  spent 0.7-0.9 ms of host time on its segments, up to 1.6 ms below 128 tokens, where cuBLAS changes kernels most
  often; a whole-graph update measured 0.2 ms when families were split by function);
- is the GPU slowdown of an updated executable (1.065x, `update_cost.py`) there when no function changes?

GPT-2 fp16 forward graphs at lengths 1..N (one shared pool, largest first). For consecutive members A < B of each
topology family (the switch a growing pass makes), up to `--pairs` pairs spread over the lengths: an executable
instantiated from A and launched once is updated to B; reported are the update's host time, the host time of the
first launch after it, the updated executable's GPU time against one instantiated from B (CUDA events, median of
`REPS` launches after two), the same update of the segments a managed graph is cut into (`segment_sizes`), and how
many kernel nodes changed function. Results are grouped by whether any function changed, and by band of lengths.

    PYTHONPATH=src:. python3 -m benchmarks.tools.update_pairs_cost --out OUT [--lengths 1024] [--pairs 96]

Writes OUT/update_pairs_cost.json.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases.graphs_memory import length_bands
from benchmarks.results import machine
from benchmarks.tools.instantiate_cost import capture_graphs
from benchmarks.tools.update_cost import gpu_ms, kernel_nodes
from tendril.cuda import graph_exec
from tendril.graphs.cuda_backend import segment_sizes

REPS = 9


def kernel_functions(raw: int) -> list[int]:
    """The function of each kernel node of the graph `raw`, in creation order (-1 where it cannot be read)."""
    from cuda.bindings import driver

    functions = []
    for node in kernel_nodes(raw):
        err, params = driver.cuGraphKernelNodeGetParams(node)
        functions.append(int(params.func) if int(err) == 0 else -1)
    return functions


def host_ms(fn: Callable[[], Any]) -> tuple[float, Any]:
    begin = time.perf_counter()
    value = fn()
    return (time.perf_counter() - begin) * 1e3, value


def measure_pair(raw: list[int], a: int, b: int, stream: int) -> dict[str, Any]:
    """Switch an executable of length `a`'s graph to length `b`'s (whole, then as segments)."""

    def launch_all(executables: list[int]) -> None:
        for executable in executables:
            graph_exec.launch(executable, stream)

    fresh = graph_exec.instantiate(raw[b - 1])
    graph_exec.upload(fresh, stream)
    fresh_ms = gpu_ms(lambda: launch_all([fresh]), REPS)
    graph_exec.destroy(fresh)

    executable = graph_exec.instantiate(raw[a - 1])
    launch_all([executable])
    torch.cuda.synchronize()
    update_ms, outcome = host_ms(lambda: graph_exec.update(executable, raw[b - 1]))
    if not outcome.ok:
        graph_exec.destroy(executable)
        return {"a": a, "b": b, "refused": outcome.reason}
    first_launch_ms, _ = host_ms(lambda: launch_all([executable]))
    torch.cuda.synchronize()
    updated_ms = gpu_ms(lambda: launch_all([executable]), REPS)
    graph_exec.destroy(executable)

    sizes = segment_sizes(graph_exec.topology(raw[a - 1]).nodes)
    cut = {n: graph_exec.split(raw[n - 1], sizes) or [raw[n - 1]] for n in (a, b)}
    segments = [graph_exec.instantiate(s) for s in cut[a]]
    launch_all(segments)
    torch.cuda.synchronize()
    segment_update_ms = []
    for handle, target in zip(segments, cut[b], strict=True):
        elapsed, outcome = host_ms(lambda handle=handle, target=target: graph_exec.update(handle, target))
        segment_update_ms.append(elapsed)
    for handle in segments:
        graph_exec.destroy(handle)
    for made in cut.values():
        if len(made) > 1:
            for segment in made:
                graph_exec.destroy_graph(segment)

    functions = list(zip(kernel_functions(raw[a - 1]), kernel_functions(raw[b - 1]), strict=True))
    return {
        "a": a,
        "b": b,
        "kernel_nodes": len(functions),
        "functions_changed": sum(x != y for x, y in functions),
        "update_host_ms": update_ms,
        "first_launch_host_ms": first_launch_ms,
        "segments_update_host_ms": segment_update_ms,
        "gpu_ms_updated": updated_ms,
        "gpu_ms_fresh": fresh_ms,
    }


def summary(pairs: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "pairs": len(pairs),
        "update_host_us_per_kernel_node": statistics.median(
            1e3 * p["update_host_ms"] / p["kernel_nodes"] for p in pairs
        ),
        "update_host_ms": statistics.median(p["update_host_ms"] for p in pairs),
        "segments_update_host_ms": statistics.median(sum(p["segments_update_host_ms"]) for p in pairs),
        "first_segment_update_host_ms": statistics.median(p["segments_update_host_ms"][0] for p in pairs),
        "first_launch_host_ms": statistics.median(p["first_launch_host_ms"] for p in pairs),
        "gpu_ratio_updated_to_fresh": statistics.median(p["gpu_ms_updated"] / p["gpu_ms_fresh"] for p in pairs),
        "gpu_ms_fresh": statistics.median(p["gpu_ms_fresh"] for p in pairs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, default=1024)
    parser.add_argument("--pairs", type=int, default=96)
    args = parser.parse_args()
    captured, raw = capture_graphs(args.lengths)  # the torch graphs own the raw handles: keep them alive
    lengths = list(range(1, len(raw) + 1))
    families: dict[str, list[int]] = defaultdict(list)
    for n in lengths:
        families[graph_exec.topology(raw[n - 1]).digest].append(n)
    candidates = sorted(pair for members in families.values() for pair in itertools.pairwise(members))
    step = max(len(candidates) / args.pairs, 1.0)
    chosen = sorted({candidates[int(i * step)] for i in range(min(args.pairs, len(candidates)))})
    stream = torch.cuda.current_stream().cuda_stream
    pairs = [measure_pair(raw, a, b, stream) for a, b in chosen]
    measured = [p for p in pairs if "refused" not in p]
    groups = {
        "same_functions": [p for p in measured if p["functions_changed"] == 0],
        "functions_changed": [p for p in measured if p["functions_changed"] > 0],
    }
    bands = length_bands(lengths)
    result: dict[str, Any] = {
        "command": f"python -m benchmarks.tools.update_pairs_cost --out {args.out} --lengths {args.lengths} "
        f"--pairs {args.pairs}",
        **machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "lengths": len(lengths),
        "families": len(families),
        "refused": [p for p in pairs if "refused" in p],
        "summary": {name: summary(group) for name, group in groups.items() if group},
        "summary_by_band": {
            f"{low}-{high}": {
                name: summary(selected)
                for name, group in groups.items()
                if (selected := [p for p in group if low <= p["b"] <= high])
            }
            for low, high in bands
        },
        "pairs": pairs,
    }
    del captured
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "update_pairs_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("families", "summary", "summary_by_band")}, indent=1), flush=True)


if __name__ == "__main__":
    main()
