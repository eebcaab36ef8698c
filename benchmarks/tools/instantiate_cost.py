"""What making and dropping executables costs, and whether a background thread can do it while the GPU runs.

A diagnostic behind the `graphs-memory` latency targets. GPT-2 fp16 (random weights) forward graphs at
lengths 1..N (captured with `torch.cuda.graph`, one shared pool, with the attention kernels tendril captures
with; the committed results predate that and ran PyTorch's own choice), then:

1. host time of `cudaGraphInstantiateWithFlags`, of the first launch after it, and of
   `cudaGraphExecDestroy`, per graph (medians);
2. per-call wall time of dedicated executables, lengths growing by one per call, a synchronisation
   after every call (the latency case's loop), alone;
3. the same loop while a background thread instantiates and destroys executables of the other graphs
   without pause: does the foreground slow down, and how many instantiations per second does the
   background thread reach;
4. prefetching as a budgeted cache would: while each call runs, the executable of the next length is
   made on a background thread; the call waits for its own executable if it is not ready yet, and is
   destroyed after it, in three arrangements of the background work (`WORKER_PATTERNS`). Reports
   per-call time, the waits and the host time of each background task.

    PYTHONPATH=src:. python3 -m benchmarks.tools.instantiate_cost --out OUT [--lengths 256]

Writes OUT/instantiate_cost.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from benchmarks.cases import graphs_memory as case
from tendril.cuda import graph_exec
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS


def capture_graphs(count: int) -> tuple[list[torch.cuda.CUDAGraph], list[int]]:
    """GPT-2 fp16 forward graphs at lengths 1..count (kept, not instantiated), largest first into one pool, with the
    attention kernels tendril captures with; returns them and their raw handles in order of length."""
    device = torch.device("cuda")
    model = case._gpt2(device)
    ids = {n: torch.randint(0, case.VOCAB, (1, n), device=device) for n in range(1, count + 1)}
    graphs, pool = [], None
    with torch.inference_mode(), sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):
        case._load_kernels(model, ids)
        for n in range(count, 0, -1):
            model(ids[n])
            graph = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graph, pool=pool):
                model(ids[n])
            pool = graph.pool()
            graphs.append(graph)
    graphs.reverse()
    return graphs, [g.raw_cuda_graph() for g in graphs]


def ms(seconds: float) -> float:
    return seconds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, default=256)
    args = parser.parse_args()
    graphs, raw = capture_graphs(args.lengths)  # the graphs own the raw handles: keep them alive
    stream = torch.cuda.current_stream().cuda_stream
    result: dict[str, Any] = {"lengths": len(graphs)}

    instantiate_ms, first_launch_ms, destroy_ms, executables = [], [], [], []
    for handle in raw:
        begin = time.perf_counter()
        executable = graph_exec.instantiate(handle)
        instantiate_ms.append(ms(time.perf_counter() - begin))
        torch.cuda.synchronize()
        begin = time.perf_counter()
        graph_exec.launch(executable, stream)
        first_launch_ms.append(ms(time.perf_counter() - begin))
        torch.cuda.synchronize()
        executables.append(executable)
    result["instantiate_ms_median"] = statistics.median(instantiate_ms)
    result["first_launch_host_ms_median"] = statistics.median(first_launch_ms)

    def growing_loop(order: list[int]) -> list[float]:
        times = []
        for index in order:
            begin = time.perf_counter()
            graph_exec.launch(executables[index], stream)
            torch.cuda.synchronize()
            times.append(ms(time.perf_counter() - begin))
        return times

    order = list(range(args.lengths))
    growing_loop(order)
    result["dedicated_ms_per_call_median"] = statistics.median(growing_loop(order))

    stop = threading.Event()
    churned = [0]

    def churn() -> None:
        while not stop.is_set():
            handle = raw[churned[0] % len(raw)]
            graph_exec.destroy(graph_exec.instantiate(handle))
            churned[0] += 1

    worker = threading.Thread(target=churn)
    begin = time.perf_counter()
    worker.start()
    contended = growing_loop(order) + growing_loop(order)
    stop.set()
    worker.join()
    result["dedicated_with_background_churn_ms_per_call_median"] = statistics.median(contended)
    result["background_instantiations_per_s"] = churned[0] / (time.perf_counter() - begin)

    for executable in executables:
        begin = time.perf_counter()
        graph_exec.destroy(executable)
        destroy_ms.append(ms(time.perf_counter() - begin))
    result["destroy_ms_median"] = statistics.median(destroy_ms)

    for pattern in WORKER_PATTERNS:
        result[f"prefetch_{pattern}"] = prefetch_loop(raw, stream, pattern)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "instantiate_cost.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


WORKER_PATTERNS = {
    "serial": "one worker thread: destroy the evicted executable, instantiate the next, upload it",
    "split": "instantiate + upload on one worker thread, destroys on a second",
    "no_upload": "one worker thread: destroy, instantiate; the first launch uploads on the calling thread",
}


def prefetch_loop(raw: list[int], stream: int, pattern: str) -> dict[str, float]:
    """Lengths growing by one per call, the next call's executable made in the background while this one runs
    (as a budgeted cache prefetches: `WORKER_PATTERNS`); the executable of the call is destroyed after it.
    Reports per-call wall time, the calls that waited for their executable, and the worker tasks' host time."""
    task_ms: dict[str, list[float]] = {"instantiate": [], "upload": [], "destroy": []}

    def timed(name: str, fn: Any, *args: Any) -> Any:
        begin = time.perf_counter()
        value = fn(*args)
        task_ms[name].append(ms(time.perf_counter() - begin))
        return value

    def make(handle: int) -> int:
        with torch.cuda.device(0):
            executable = timed("instantiate", graph_exec.instantiate, handle)
            if pattern != "no_upload":
                timed("upload", graph_exec.upload, executable, stream)
            return executable

    def drop(executable: int) -> None:
        with torch.cuda.device(0):
            timed("destroy", graph_exec.destroy, executable)

    makers = ThreadPoolExecutor(1)
    droppers = ThreadPoolExecutor(1) if pattern == "split" else makers
    times: list[float] = []
    waits: list[float] = []
    for _ in range(2):  # the first pass warms up
        times.clear()
        waits.clear()
        for values in task_ms.values():
            values.clear()
        pending: dict[int, Future[int]] = {0: makers.submit(make, raw[0])}
        for index in range(len(raw)):
            if index + 1 < len(raw):
                pending[index + 1] = makers.submit(make, raw[index + 1])
            begin = time.perf_counter()
            ready = pending[index].done()
            executable = pending.pop(index).result()
            waits.append(0.0 if ready else 1.0)
            graph_exec.launch(executable, stream)
            torch.cuda.synchronize()
            times.append(ms(time.perf_counter() - begin))
            droppers.submit(drop, executable)
    makers.shutdown(wait=True)
    droppers.shutdown(wait=True)
    result = {"ms_per_call_median": statistics.median(times), "ms_per_call_mean": statistics.fmean(times),
              "calls_that_waited": sum(waits) / len(waits)}
    result.update({f"worker_{name}_ms_median": statistics.median(v) for name, v in task_ms.items() if v})
    return result


if __name__ == "__main__":
    main()
