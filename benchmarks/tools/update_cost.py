"""Does an updated executable run as fast as a fresh one? GPU time of one launch (a diagnostic behind `graphs-memory`).

GPT-2 fp16 (random weights) forward graphs at lengths LOW..HIGH, captured with `torch.cuda.graph` into one pool;
A and B are two lengths of the largest topology family there. Each variant is an executable that runs A's graph:

- `fresh`: instantiated from A (and uploaded);
- `updated`: instantiated from B, switched to A by `cudaGraphExecUpdate`; `updated_uploaded`: then `cudaGraphUpload`;
- `identity_update`: instantiated from A, updated to A;
- `set_params`: instantiated from B, every kernel node set to A's parameters by `cuGraphExecKernelNodeSetParams`;
- `updated_and_back` (against `fresh_b`): instantiated from B, updated to A, then back to B: it runs B;
- `segments_fresh` / `segments_updated`: A cut as a managed graph is (`cuda_backend.segment_sizes`), one executable
  per segment, instantiated from A's segments or updated to them from B's.

GPU time: CUDA events around one launch on an idle stream, median of `REPS` launches after two; every variant's
output is compared with the fresh executable's. Writes OUT/update_cost.json and OUT/update_cost.md.

    PYTHONPATH=src:. python3 -m benchmarks.tools.update_cost --out OUT [--low 529 --high 559]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from benchmarks.cases import graphs_memory as case
from tendril.cuda import graph_exec
from tendril.cuda.runtime import check
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS
from tendril.graphs.cuda_backend import segment_sizes

REPS = 25


def gpu_ms(launch: Callable[[], None], reps: int = REPS) -> float:
    """Median GPU time of `launch` on an idle stream over `reps` launches (two more before them left out)."""
    stream = torch.cuda.current_stream()
    times = []
    for _ in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(stream)
        launch()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def kernel_nodes(raw: int) -> list[Any]:
    """The kernel nodes of the graph `raw` in creation order, as driver-API handles."""
    from cuda.bindings import driver, runtime

    handle = runtime.cudaGraph_t(init_value=raw)
    count = runtime.cudaGraphGetNodes(handle, 0)[-1]
    nodes = list(runtime.cudaGraphGetNodes(handle, count)[1])[:count]
    kernel = runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel
    return [driver.CUgraphNode(init_value=int(n)) for n in nodes if runtime.cudaGraphNodeGetType(n)[1] == kernel]


def set_kernel_params(executable: int, source: int, target: int) -> None:
    """Set every kernel node of `executable` (instantiated from `source`) to `target`'s parameters."""
    from cuda.bindings import driver

    handle = driver.CUgraphExec(init_value=executable)
    for node, model in zip(kernel_nodes(source), kernel_nodes(target), strict=True):
        params = check(driver.cuGraphKernelNodeGetParams(model), "cuGraphKernelNodeGetParams")
        check(driver.cuGraphExecKernelNodeSetParams(handle, node, params), "cuGraphExecKernelNodeSetParams")


def measure(low: int, high: int) -> dict[str, Any]:
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = case._gpt2(device)
    lengths = list(range(low, high + 1))
    ids = {n: torch.randint(0, case.VOCAB, (1, n), device=device) for n in lengths}
    graphs, outputs = {}, {}
    pool = torch.cuda.graph_pool_handle()
    with torch.inference_mode(), sdpa_kernel(list(GRAPH_SDPA_BACKENDS)):
        for n in lengths:
            model(ids[n])
        torch.cuda.synchronize()
        for n in reversed(lengths):
            graphs[n] = torch.cuda.CUDAGraph(keep_graph=True)
            with torch.cuda.graph(graphs[n], pool=pool):
                outputs[n] = model(ids[n]).logits
    raw = {n: graphs[n].raw_cuda_graph() for n in lengths}
    families: dict[str, list[int]] = defaultdict(list)
    for n in lengths:
        families[graph_exec.topology(raw[n]).digest].append(n)
    members = max(families.values(), key=len)
    a, b = members[len(members) // 2], members[0]
    stream = torch.cuda.current_stream().cuda_stream
    sizes = segment_sizes(graph_exec.topology(raw[a]).nodes)
    segments = {n: graph_exec.split(raw[n], sizes) or [raw[n]] for n in (a, b)}
    expected: dict[int, torch.Tensor] = {}
    """Output of the first executable measured that runs each length (the reference of the later ones)."""
    exact: dict[str, bool] = {}

    def run(
        label: str, sources: list[int], targets: list[int] | None, length: int, switch: Callable[..., None]
    ) -> float:
        executables = [graph_exec.instantiate(s) for s in sources]
        for executable, source, target in zip(executables, sources, targets or sources, strict=True):
            switch(executable, source, target)

        def launch() -> None:
            for executable in executables:
                graph_exec.launch(executable, stream)

        with torch.inference_mode():
            outputs[length].fill_(float("nan"))
        launch()
        torch.cuda.synchronize()
        if length in expected:
            exact[label] = bool(torch.equal(outputs[length], expected[length]))
        else:
            expected[length] = outputs[length].clone()
        elapsed = gpu_ms(launch)
        for executable in executables:
            graph_exec.destroy(executable)
        return elapsed

    def upload_only(executable: int, source: int, target: int) -> None:
        graph_exec.upload(executable, stream)

    def update(executable: int, source: int, target: int) -> None:
        assert graph_exec.update(executable, target).ok

    def update_upload(executable: int, source: int, target: int) -> None:
        update(executable, source, target)
        graph_exec.upload(executable, stream)

    def there_and_back(executable: int, source: int, target: int) -> None:
        assert graph_exec.update(executable, raw[a]).ok and graph_exec.update(executable, source).ok

    def set_params(executable: int, source: int, target: int) -> None:
        set_kernel_params(executable, source, target)

    ms = {
        "fresh": run("fresh", [raw[a]], None, a, upload_only),
        "updated": run("updated", [raw[b]], [raw[a]], a, update),
        "updated_uploaded": run("updated_uploaded", [raw[b]], [raw[a]], a, update_upload),
        "identity_update": run("identity_update", [raw[a]], [raw[a]], a, update),
        "set_params": run("set_params", [raw[b]], [raw[a]], a, set_params),
        "fresh_b": run("fresh_b", [raw[b]], None, b, upload_only),
        "updated_and_back": run("updated_and_back", [raw[b]], None, b, there_and_back),
        "segments_fresh": run("segments_fresh", segments[a], None, a, upload_only),
        "segments_updated": run("segments_updated", segments[b], segments[a], a, update),
    }
    for made in segments.values():
        if len(made) > 1:
            for segment in made:
                graph_exec.destroy_graph(segment)
    reference = {"fresh_b": "fresh_b", "updated_and_back": "fresh_b"}
    return {
        "lengths": [low, high],
        "family": members,
        "a": a,
        "b": b,
        "segment_sizes": list(sizes),
        "gpu_ms": ms,
        "ratio_to_fresh": {k: v / ms[reference.get(k, "fresh")] for k, v in ms.items()},
        "exact": exact,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Tool `update_cost`: GPU time of an updated executable against a fresh one",
        "",
        f"- command: `{result['command']}`",
        f"- device: {result['device']}; torch {result['torch']}; {result['date']}",
        f"- GPT-2 fp16 forward, A = length {result['a']}, B = length {result['b']} (one topology family); "
        f"segments {result['segment_sizes']}",
        "",
        "| executable | GPU ms (median) | ratio to fresh | same output |",
        "|---|---:|---:|---|",
    ]
    for name, value in result["gpu_ms"].items():
        same = result["exact"].get(name, "(reference)")
        lines.append(f"| {name} | {value:.4f} | {result['ratio_to_fresh'][name]:.3f} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--low", type=int, default=529)
    parser.add_argument("--high", type=int, default=559)
    args = parser.parse_args()
    result = {
        "command": f"python -m benchmarks.tools.update_cost --out {args.out} --low {args.low} --high {args.high}",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **measure(args.low, args.high),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "update_cost.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "update_cost.md").write_text(markdown(result))
    print(markdown(result), flush=True)


if __name__ == "__main__":
    main()
