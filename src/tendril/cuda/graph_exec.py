"""Executable CUDA graphs managed through cuda-python: instantiate, upload, update, launch, destroy, topology,
and `split` (a graph cut into segments of consecutive nodes, run one after the other).

torch's `CUDAGraph(keep_graph=True)` keeps the captured `cudaGraph_t` (`raw_cuda_graph()`) without
instantiating it; these calls turn such a graph into executables whose lifetime tendril controls, so
the driver memory each executable holds can be given back (destroy) or shared between graphs of
one topology (update) while the captured graphs stay on the host.

What CUDA guarantees about executables that are still running (and why no host wait is needed):

- `cudaGraphExecUpdate` and the per-node `cudaGraphExec*SetParams` calls change only *future*
  launches: "Already enqueued or running launches of hGraphExec are not affected by this call"
  (CUDA runtime API reference). Updating an executable whose previous launch is still on the GPU is
  therefore allowed and does not disturb that launch.
- `cuGraphExecDestroy`: "If the executable graph is in-flight, it will not be terminated, but rather
  freed asynchronously on completion" (CUDA driver API reference).

So the host may update or destroy an executable right after launching it, as documented. (tendril's
policy driver, `CudaExecutables`, still waits for the last launch first: see there.) What the host must order
is the *memory* the graphs share (pool, placeholders, outputs): that is stream ordering, handled by
the caller (`tendril.graphs.executables`). Launches go to the stream given, normally torch's current
stream. A failed update is reported, never raised: the caller destroys that executable and
instantiates a fresh one (the pattern the CUDA programming guide recommends).

Background threads. These calls may run on a thread other than the one launching (tendril's prefetching
worker instantiates, uploads and destroys there). `relax_capture_mode` makes such a thread's calls legal
while another thread captures a graph in CUDA's default (global) interaction mode: instantiating and
destroying allocate and free device memory, which global mode would forbid and which would invalidate
that capture. `upload` moves the work the first launch of a fresh executable does into an upload enqueued on a
stream ahead of it.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tendril.cuda.runtime import CudaError, check

INSTANTIATE_FLAGS = 1
"""`cudaGraphInstantiateFlagAutoFreeOnLaunch`, as torch instantiates its graphs (matters only for graphs with
memory-allocation nodes, which torch's captures do not make)."""


@dataclass(frozen=True)
class UpdateOutcome:
    """Whether `update` switched the executable to the new graph, and if not, CUDA's reason."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True)
class Topology:
    """A captured graph's shape: node count (top level) and a digest of node types in creation order, the launch
    configuration of every kernel node (`_kernel_launch`), and the edges with their data, child graphs included.

    Graphs with equal digests form a family: candidates for `update`, which changes kernel functions, arguments,
    launch dimensions and copy/memset parameters. CUDA accepts updates that swap a kernel node's function (same
    context, no change of dynamic parallelism or cooperativeness), and cuBLAS picks other kernels at other problem
    sizes, so the function is left out: a model's graphs at many lengths then make far fewer families than they
    would by function. The GPU tests switch executables between graphs of other
    functions (elementwise kernels; GPT-2 at random lengths) and compare them with dedicated executables bit for
    bit. A kernel node whose configuration cannot be read gets a digest of its own (no updates)."""

    nodes: int
    digest: str


def _graph(raw: int) -> Any:
    from cuda.bindings import runtime

    return runtime.cudaGraph_t(init_value=raw)


def _exec(raw: int) -> Any:
    from cuda.bindings import runtime

    return runtime.cudaGraphExec_t(init_value=raw)


def instantiate(graph: int) -> int:
    """Instantiate the captured graph `graph` (an int handle, e.g. `CUDAGraph.raw_cuda_graph()`); return the
    executable's handle."""
    from cuda.bindings import runtime

    executable = check(
        runtime.cudaGraphInstantiateWithFlags(_graph(graph), INSTANTIATE_FLAGS), "cudaGraphInstantiateWithFlags"
    )
    return int(executable)


def upload(executable: int, stream: int) -> None:
    """Upload `executable` to the device in `stream` (a `torch.cuda.Stream.cuda_stream` handle) without running
    it, so that its first launch does not pay for the upload. Ordered behind the work already in `stream` and
    the executable's earlier launches (CUDA runtime API reference)."""
    from cuda.bindings import runtime

    check(runtime.cudaGraphUpload(_exec(executable), runtime.cudaStream_t(init_value=stream)), "cudaGraphUpload")


def relax_capture_mode() -> None:
    """Let this thread make calls that a capture in global mode on another thread would forbid (and be
    invalidated by): instantiating, uploading and destroying executables on a background thread."""
    from cuda.bindings import runtime

    check(
        runtime.cudaThreadExchangeStreamCaptureMode(runtime.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed),
        "cudaThreadExchangeStreamCaptureMode",
    )


def update(executable: int, graph: int) -> UpdateOutcome:
    """Make `executable` run `graph` (same topology) from its next launch on; launches already enqueued keep
    the parameters they were launched with. A refused update leaves an outcome with CUDA's reason."""
    from cuda.bindings import runtime

    err, info = runtime.cudaGraphExecUpdate(_exec(executable), _graph(graph))
    if int(err) == 0:
        return UpdateOutcome(True)
    runtime.cudaGetLastError()  # a refused update is expected; do not leave it as the thread's last error
    result = getattr(getattr(info, "result", None), "name", None) or getattr(err, "name", str(err))
    return UpdateOutcome(False, str(result))


def launch(executable: int, stream: int) -> None:
    """Enqueue `executable` on `stream` (a `torch.cuda.Stream.cuda_stream` handle)."""
    from cuda.bindings import runtime

    check(runtime.cudaGraphLaunch(_exec(executable), runtime.cudaStream_t(init_value=stream)), "cudaGraphLaunch")


def destroy(executable: int) -> None:
    """Destroy `executable`; a launch of it still running completes first (the driver frees it afterwards)."""
    from cuda.bindings import runtime

    check(runtime.cudaGraphExecDestroy(_exec(executable)), "cudaGraphExecDestroy")


def topology(graph: int) -> Topology:
    """The node count and topology digest of the captured graph `graph` (host calls only).

    The digest covers node types in creation order, every kernel node's launch configuration and the edges with
    their data, and the same inside child-graph nodes (libraries such as cuDNN's frontend can capture their work
    as a child graph). Where the bindings cannot read edges losslessly the digest says so and covers the rest:
    CUDA then refuses the updates whose edges differ, and the cache re-instantiates."""
    digest = hashlib.sha1()
    count = _digest_graph(_graph(graph), graph, digest, {})
    return Topology(count, digest.hexdigest()[:16])


def _digest_graph(handle: Any, graph: int, digest: Any, requirements: dict[int, str]) -> int:
    """Add `handle`'s nodes (recursively into child graphs) and edges to `digest`; return its node count.
    `requirements` caches `_cluster_requirements` per function for this digest."""
    from cuda.bindings import runtime

    nodes = _nodes(handle)
    index = {int(node): position for position, node in enumerate(nodes)}
    count = len(nodes)
    digest.update(f"{count};".encode())
    for node in nodes:
        err, kind = runtime.cudaGraphNodeGetType(node)
        digest.update(f"{getattr(kind, 'name', kind) if int(err) == 0 else '?'},".encode())
        if int(err) != 0:
            continue
        if kind == runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel:
            digest.update(f"{_kernel_launch(node, graph, requirements)};".encode())
        elif kind == runtime.cudaGraphNodeType.cudaGraphNodeTypeGraph:
            child_err, child = runtime.cudaGraphChildGraphNodeGetGraph(node)
            if int(child_err) != 0:
                digest.update(f"unknown child graph in graph {graph};".encode())
                continue
            digest.update(b"{")
            _digest_graph(child, graph, digest, requirements)
            digest.update(b"}")
    try:
        edges = _edges(handle)
    except CudaError as error:
        digest.update(f"edges unread: {error}".encode())
    else:
        for source, target, data in edges:
            kind = (data.type, data.from_port, data.to_port) if data is not None else ()
            digest.update(f"{index.get(int(source), -1)}>{index.get(int(target), -1)}{kind};".encode())
    return int(count)


def _nodes(handle: Any) -> list[Any]:
    """The graph's nodes in creation order."""
    from cuda.bindings import runtime

    _, count = check(runtime.cudaGraphGetNodes(handle, 0), "cudaGraphGetNodes")
    nodes, count = check(runtime.cudaGraphGetNodes(handle, count), "cudaGraphGetNodes")
    return list(nodes)[:count]


def _dims(value: Any) -> str:
    return f"{value.x},{value.y},{value.z}"


LAUNCH_ATTRIBUTES: dict[str, Callable[[Any], Any]] = {
    "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION": lambda value: _dims(value.clusterDim),
    "CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE": lambda value: value.clusterSchedulingPolicyPreference,
    "CU_LAUNCH_ATTRIBUTE_COOPERATIVE": lambda value: value.cooperative,
}
"""The kernel-node launch attributes a family must share, and how each value is read (driver 580 reads these
on graph nodes; the preferred cluster dimension, say, it does not)."""

FUNCTION_CLUSTER_ATTRIBUTES = (
    "CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH",
    "CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_HEIGHT",
    "CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_DEPTH",
    "CU_FUNC_ATTRIBUTE_CLUSTER_SIZE_MUST_BE_SET",
    "CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED",
)
"""The cluster requirements a kernel function is compiled with, which a family's functions must share."""


def _kernel_launch(node: Any, graph: int, requirements: dict[int, str]) -> str:
    """A kernel node's launch configuration as a string (not its function), or one unique to `graph` when CUDA
    cannot say: the launch attributes of `LAUNCH_ATTRIBUTES` and the function's cluster requirements.

    The cluster shape is part of it: cuBLAS launches one function with other cluster shapes at other problem
    sizes, and `cudaGraphExecUpdate` between such nodes is accepted but can end in an illegal instruction. Through
    the driver API: the runtime's `cudaGraphKernelNodeGetParams` answers "invalid device function"
    for kernels that torch's own (statically linked) runtime launched."""
    from cuda.bindings import driver

    handle = driver.CUgraphNode(init_value=int(node))
    err, params = driver.cuGraphKernelNodeGetParams(handle)
    if int(err) != 0 or params is None:
        return f"unknown kernel in graph {graph}"
    parts = []
    for name, read in LAUNCH_ATTRIBUTES.items():
        err, value = driver.cuGraphKernelNodeGetAttribute(handle, getattr(driver.CUlaunchAttributeID, name))
        if int(err) != 0:
            return f"unknown {name} of a node in graph {graph}"
        parts.append(str(read(value)))
    function = int(params.func)
    if function not in requirements:
        requirements[function] = _cluster_requirements(params.func)
    parts.append(requirements[function])
    return "@".join(parts)


def _cluster_requirements(function: Any) -> str:
    """The function's `FUNCTION_CLUSTER_ATTRIBUTES`, or the function itself where one cannot be read (so that
    only nodes running that very function match)."""
    from cuda.bindings import driver

    values = []
    for name in FUNCTION_CLUSTER_ATTRIBUTES:
        err, value = driver.cuFuncGetAttribute(getattr(driver.CUfunction_attribute, name), function)
        if int(err) != 0:
            return f"function {int(function)}"
        values.append(str(value))
    return ",".join(values)


SEGMENTABLE_NODES = (
    "cudaGraphNodeTypeKernel",
    "cudaGraphNodeTypeMemcpy",
    "cudaGraphNodeTypeMemset",
    "cudaGraphNodeTypeEmpty",
    "cudaGraphNodeTypeGraph",
)
"""Node kinds `split` cuts between: work that needs nothing of the nodes before it but their completion (an event,
a conditional or a memory node may pair with a node in another segment, so graphs holding one stay whole)."""


def split(graph: int, sizes: Sequence[int]) -> list[int] | None:
    """`graph` cut into graphs of consecutive nodes in creation order, `sizes[i]` nodes in the i-th, or None where it
    cannot be cut so: fewer than two sizes, a node kind outside `SEGMENTABLE_NODES`, or an edge against creation
    order. The sizes must add up to the graph's node count.

    Each segment is a clone of `graph` with the other nodes destroyed, so its nodes' parameters, attributes and
    the edges among them are CUDA's own copy; an edge from an earlier segment goes with its source node. Launched
    one after the other in one stream, the segments run what `graph` runs: stream order is at least every edge
    cut. The caller owns the segments (`destroy_graph`)."""
    from cuda.bindings import runtime

    if len(sizes) < 2:
        return None
    handle = _graph(graph)
    nodes = _nodes(handle)
    if sum(sizes) != len(nodes) or min(sizes) < 1:
        raise ValueError(f"segment sizes {list(sizes)} do not cut a graph of {len(nodes)} nodes")
    for node in nodes:
        err, kind = runtime.cudaGraphNodeGetType(node)
        if int(err) != 0 or getattr(kind, "name", None) not in SEGMENTABLE_NODES:
            return None
    position = {int(node): index for index, node in enumerate(nodes)}
    if any(position[int(source)] > position[int(target)] for source, target, _ in _edges(handle)):
        return None
    cuts = list(itertools.accumulate(sizes, initial=0))
    made: list[int] = []
    try:
        for first, end in itertools.pairwise(cuts):
            clone = check(runtime.cudaGraphClone(handle), "cudaGraphClone")
            made.append(int(clone))
            for index, node in enumerate(nodes):
                if not first <= index < end:
                    copy = check(runtime.cudaGraphNodeFindInClone(node, clone), "cudaGraphNodeFindInClone")
                    check(runtime.cudaGraphDestroyNode(copy), "cudaGraphDestroyNode")
    except BaseException:
        for segment in made:
            destroy_graph(segment)
        raise
    return made


def destroy_graph(graph: int) -> None:
    """Destroy a graph made here (a segment of `split`)."""
    from cuda.bindings import runtime

    check(runtime.cudaGraphDestroy(_graph(graph)), "cudaGraphDestroy")


def _edges(handle: Any) -> list[tuple[Any, Any, Any]]:
    """The graph's edges as (from, to, data) triples (data: a `cudaGraphEdgeData`, or None where the bindings
    return none)."""
    from cuda.bindings import runtime

    values = check(runtime.cudaGraphGetEdges(handle, 0), "cudaGraphGetEdges")
    count = values[-1]
    if not count:
        return []
    values = check(runtime.cudaGraphGetEdges(handle, count), "cudaGraphGetEdges")
    sources, targets, count = values[0], values[1], values[-1]
    data = list(values[2])[:count] if len(values) > 3 and values[2] is not None else [None] * count
    return list(zip(list(sources)[:count], list(targets)[:count], data, strict=True))
