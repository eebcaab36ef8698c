"""Executable CUDA graphs managed through cuda-python: instantiate, upload, update, launch, destroy, topology.

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
that capture. `upload` moves the work the first launch of a fresh executable does (0.27 ms of host time
per GPT-2 forward graph on the H200) into an upload enqueued on a stream ahead of it.
"""

from __future__ import annotations

import hashlib
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
    """A captured graph's shape: node count (top level) and a digest of node types in creation order, the
    function and cluster dimensions of every kernel node, and the edges, child graphs included.

    Graphs with equal digests are candidates for `update`, which then only changes kernel arguments, launch
    dimensions and copy/memset parameters, never which kernels run. CUDA accepts updates that swap a kernel
    node's function too; tendril does not ask for them. A graph whose kernel functions cannot be read gets a
    digest of its own (no updates). Before the digest covered cluster dimensions, updates of Wav2Vec2-base
    executables between graphs of equal digests ended in an illegal instruction on the H200 (driver 580): one
    cuBLAS node ran the same function with other clusters (`_kernel_function`)."""

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

    The digest covers node types in creation order, the function of every kernel node and the edges, and
    the same inside child-graph nodes (libraries such as cuDNN's frontend can capture their work as a child
    graph, whose kernels must match as much as the top level's). Where
    the bindings cannot read a part (edges with data this query cannot return losslessly, say), the digest
    says so and covers the rest: a coarser digest only makes more updates fail their check and
    re-instantiate, never changes results."""
    digest = hashlib.sha1()
    count = _digest_graph(_graph(graph), graph, digest)
    return Topology(count, digest.hexdigest()[:16])


def _digest_graph(handle: Any, graph: int, digest: Any) -> int:
    """Add `handle`'s nodes (recursively into child graphs) and edges to `digest`; return its node count."""
    from cuda.bindings import runtime

    _, count = check(runtime.cudaGraphGetNodes(handle, 0), "cudaGraphGetNodes")
    nodes, count = check(runtime.cudaGraphGetNodes(handle, count), "cudaGraphGetNodes")
    nodes = list(nodes)[:count]
    index = {int(node): position for position, node in enumerate(nodes)}
    digest.update(f"{count};".encode())
    for node in nodes:
        err, kind = runtime.cudaGraphNodeGetType(node)
        digest.update(f"{getattr(kind, 'name', kind) if int(err) == 0 else '?'},".encode())
        if int(err) != 0:
            continue
        if kind == runtime.cudaGraphNodeType.cudaGraphNodeTypeKernel:
            digest.update(f"{_kernel_function(node, graph)};".encode())
        elif kind == runtime.cudaGraphNodeType.cudaGraphNodeTypeGraph:
            child_err, child = runtime.cudaGraphChildGraphNodeGetGraph(node)
            if int(child_err) != 0:
                digest.update(f"unknown child graph in graph {graph};".encode())
                continue
            digest.update(b"{")
            _digest_graph(child, graph, digest)
            digest.update(b"}")
    try:
        edges = _edges(handle)
    except CudaError as error:
        digest.update(f"edges unread: {error}".encode())
    else:
        for source, target in edges:
            digest.update(f"{index.get(int(source), -1)}>{index.get(int(target), -1)};".encode())
    return int(count)


def _kernel_function(node: Any, graph: int) -> str:
    """The kernel node's function (`CUfunction`) and cluster dimensions as a string, or one unique to `graph`
    when CUDA cannot say.

    The cluster dimensions are part of the identity: cuBLAS launches one function with other cluster shapes at
    other problem sizes (a Wav2Vec2-base node ran with clusters of (5, 1, 1) at one length and (2, 2, 1) at
    another), and `cudaGraphExecUpdate` between such nodes is accepted but ended in an illegal instruction on
    the H200 (driver 580). Through the driver API: the runtime's `cudaGraphKernelNodeGetParams` answers
    "invalid device function" for kernels that torch's own (statically linked) runtime launched."""
    from cuda.bindings import driver

    handle = driver.CUgraphNode(init_value=int(node))
    err, params = driver.cuGraphKernelNodeGetParams(handle)
    if int(err) != 0 or params is None:
        return f"unknown function in graph {graph}"
    cluster_attribute = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    err, value = driver.cuGraphKernelNodeGetAttribute(handle, cluster_attribute)
    if int(err) != 0:
        return f"unknown cluster of a node in graph {graph}"
    cluster = value.clusterDim
    return f"{int(params.func)}@{cluster.x},{cluster.y},{cluster.z}"


def _edges(handle: Any) -> list[tuple[Any, Any]]:
    """The graph's edges as (from, to) node pairs (CUDA 13 bindings also return edge data, ignored here)."""
    from cuda.bindings import runtime

    values = check(runtime.cudaGraphGetEdges(handle, 0), "cudaGraphGetEdges")
    count = values[-1]
    if not count:
        return []
    values = check(runtime.cudaGraphGetEdges(handle, count), "cudaGraphGetEdges")
    sources, targets, count = values[0], values[1], values[-1]
    return list(zip(list(sources)[:count], list(targets)[:count], strict=True))
