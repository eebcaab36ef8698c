"""What differs between captured graphs of one topology family, node by node (a diagnostic behind `update`).

`cudaGraphExecUpdate` of Wav2Vec2-base executables between graphs of equal topology digests (then: same node
types, kernel functions and edges) ended in an illegal instruction on the H200. The digest now leaves the function
out (`graph_exec.Topology`), so `function` differing inside a family is expected. This captures the `graphs-memory`
models at several lengths, groups the graphs by tendril's digest, and compares every kernel node with its
counterpart in the family's first graph: block size, dynamic shared memory, and the launch attributes an
update may not carry over (cluster dimensions, cluster scheduling policy, programmatic stream
serialization), plus the function's own cluster requirements. Prints, per model, how many families have nodes
that differ in each field, with examples.

    PYTHONPATH=src:. python3 -m benchmarks.tools.graph_node_attributes --out OUT [--lengths 64]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.cases import graphs_memory as case
from tendril.cuda import graph_exec
from tendril.graphs.callable import graphed


def _kernel_nodes(raw: int) -> list[Any]:
    from cuda.bindings import runtime

    handle = runtime.cudaGraph_t(init_value=raw)
    count = runtime.cudaGraphGetNodes(handle, 0)[-1]
    nodes = list(runtime.cudaGraphGetNodes(handle, count)[1])[:count]
    kernel = runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel
    return [node for node in nodes if runtime.cudaGraphNodeGetType(node)[1] == kernel]


def _node_fields(node: Any) -> dict[str, Any]:
    from cuda.bindings import driver

    handle = driver.CUgraphNode(init_value=int(node))
    fields: dict[str, Any] = {}
    err, params = driver.cuGraphKernelNodeGetParams(handle)
    if int(err) == 0:
        fields["block"] = (params.blockDimX, params.blockDimY, params.blockDimZ)
        fields["shared_bytes"] = params.sharedMemBytes
        fields["function"] = int(params.func)
        for name in ("REQUIRED_CLUSTER_WIDTH", "CLUSTER_SIZE_MUST_BE_SET", "NON_PORTABLE_CLUSTER_SIZE_ALLOWED"):
            attribute = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}", None)
            if attribute is not None:
                fields[f"function_{name.lower()}"] = driver.cuFuncGetAttribute(attribute, params.func)[1]
    ids = driver.CUlaunchAttributeID
    for name, attr, read in (
        ("cluster_dim", "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION",
         lambda v: (v.clusterDim.x, v.clusterDim.y, v.clusterDim.z)),
        ("cluster_policy", "CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE",
         lambda v: int(v.clusterSchedulingPolicyPreference)),
        ("programmatic", "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION",
         lambda v: int(v.programmaticStreamSerializationAllowed)),
    ):
        err, value = driver.cuGraphKernelNodeGetAttribute(handle, getattr(ids, attr))
        fields[name] = read(value) if int(err) == 0 else f"error {err}"
    return fields


def compare_families(graphs: dict[int, Any]) -> dict[str, Any]:
    """`graphs`: {length: torch CUDAGraph kept}. Families of equal digests, and per field how many differ."""
    families: dict[str, list[int]] = collections.defaultdict(list)
    for length, graph in sorted(graphs.items()):
        families[graph_exec.topology(graph.raw_cuda_graph()).digest].append(length)
    differing: collections.Counter[str] = collections.Counter()
    examples: dict[str, list[str]] = collections.defaultdict(list)
    for lengths in families.values():
        first = [_node_fields(n) for n in _kernel_nodes(graphs[lengths[0]].raw_cuda_graph())]
        seen: set[str] = set()
        for length in lengths[1:]:
            for index, node in enumerate(_kernel_nodes(graphs[length].raw_cuda_graph())):
                fields = _node_fields(node)
                for key, value in fields.items():
                    if value != first[index].get(key):
                        seen.add(key)
                        if len(examples[key]) < 5:
                            examples[key].append(f"node {index} length {lengths[0]}: {first[index].get(key)} "
                                                 f"vs length {length}: {value}")
        differing.update(seen)
    return {"families": len(families), "multi_length_families": sum(len(v) > 1 for v in families.values()),
            "families_with_field_differing": dict(differing), "examples": dict(examples)}


def _captured(model: Any, examples: dict[int, tuple[torch.Tensor, ...]]) -> dict[int, Any]:
    fast = graphed(model, max_graphs=len(examples), graph_memory_budget="1GiB", graph_memory_strategy="lru")
    fast.capture([examples[n] for n in sorted(examples, reverse=True)], progress=False)
    (cache,) = fast._backend.executable_caches().values()
    by_key = {key: source.graph for key, source in cache._sources.items()}
    return {n: graph for n, graph in zip(sorted(examples, reverse=True), by_key.values(), strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lengths", type=int, default=64)
    args = parser.parse_args()
    device = torch.device("cuda")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with torch.inference_mode():
        encoder = case._wav2vec2(device)
        lengths = case.spread(case.SAMPLE_RATE, 16 * case.SAMPLE_RATE, args.lengths)
        audio = {n: (torch.randn(1, n, device=device, dtype=torch.float16),) for n in lengths}
        case._load_kernels(encoder, {n: a[0] for n, a in audio.items()})
        report["wav2vec2"] = compare_families(_captured(encoder, audio))
        print("wav2vec2", json.dumps(report["wav2vec2"]), flush=True)
        del encoder
        gpt2 = case._gpt2(device)
        ids = {n: (torch.randint(0, case.VOCAB, (1, n), device=device),) for n in range(1, args.lengths + 1)}
        case._load_kernels(gpt2, {n: i[0] for n, i in ids.items()})
        report["gpt2"] = compare_families(_captured(gpt2, ids))
        print("gpt2", json.dumps(report["gpt2"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "graph-node-attributes.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
