"""Conditional graph nodes added to a CUDA graph while torch captures it, through cuda-python.

A stream that is being captured has a graph under construction and a set of "current" nodes the next
captured operation will depend on (`capture_info`). Device-side control flow is spliced in there:

1. `create_conditional_handle(graph)`: a conditional variable owned by that graph.
2. `set_condition(handle, flag)`: a one-thread kernel (NVRTC), captured like any other launch, that
   copies a 0-d bool tensor into the conditional variable (`cudaGraphSetConditional` on the device).
3. `add_conditional_node(info, handle, kind, branches)`: an IF (one or two branches) or WHILE node that
   depends on the current nodes; CUDA creates its empty body graphs.
4. `capture_to_graph(stream, body)`: a second capture, on another stream, that records into a body
   graph (`cudaStreamBeginCaptureToGraph`); a WHILE body ends with `set_condition` for the next test.
5. `set_capture_dependencies(stream, [node])`: what the outer stream captures next runs after the node.

Body graphs may hold kernels, memsets, memcopies, child graphs and further conditional nodes: what
torch captures for ordinary tensor code on one stream. Nothing here synchronizes with the host.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tendril.cuda.runtime import CudaError, check

if TYPE_CHECKING:
    from tendril.cuda.nvrtc import Kernel

# `cudaGraphSetConditional` is a CUDA device-runtime builtin: ptxas resolves the call itself, so the kernel
# needs neither relocatable code nor cudadevrt, and declaring it here avoids depending on the toolkit's
# headers being installed beside NVRTC (the declaration matches cuda_device_runtime_api.h).
_SET_CONDITION_SOURCE = r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle, unsigned int value);

extern "C" __global__ void tendril_set_condition(cudaGraphConditionalHandle handle, const bool* flag) {
    cudaGraphSetConditional(handle, *flag ? 1u : 0u);
}
"""


class ConditionalKind(enum.Enum):
    IF = "if"
    WHILE = "while"


@dataclass(frozen=True)
class CaptureInfo:
    """Where a capturing stream stands: its graph, capture sequence id, and the nodes next work depends on."""

    graph: Any
    capture_id: int
    dependencies: list[Any]
    edge_data: list[Any]


def capture_info(stream: torch.cuda.Stream) -> CaptureInfo | None:
    """The capture `stream` takes part in, or None when it is not capturing. Raises if it was invalidated."""
    from cuda.bindings import runtime

    values = check(runtime.cudaStreamGetCaptureInfo(stream.cuda_stream), "cudaStreamGetCaptureInfo")
    if len(values) == 6:  # CUDA 13 bindings: status, id, graph, dependencies, edge data, count
        status, capture_id, graph, dependencies, edge_data, count = values
    else:  # CUDA 12 bindings: no edge data
        status, capture_id, graph, dependencies, count = values
        edge_data = []
    if status == runtime.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone:
        return None
    if status != runtime.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
        raise CudaError(
            "the stream's CUDA graph capture was invalidated by an earlier operation (typically a host "
            "synchronization or a use of a non-capturing stream); the capture cannot continue"
        )
    return CaptureInfo(graph, int(capture_id), list(dependencies)[:count], list(edge_data or [])[:count])


def create_conditional_handle(graph: Any) -> Any:
    """A conditional variable owned by `graph`, for a conditional node in it or in one of its bodies."""
    from cuda.bindings import runtime

    return check(runtime.cudaGraphConditionalHandleCreate(graph, 0, 0), "cudaGraphConditionalHandleCreate")


def set_condition(handle: Any, flag: torch.Tensor) -> None:
    """Enqueue, on torch's current stream, a kernel that sets `handle` to `flag` (a one-element bool tensor)."""
    if flag.dtype != torch.bool or flag.numel() != 1 or flag.device.type != "cuda":
        raise ValueError(f"a condition must be a one-element bool CUDA tensor, got {flag.dtype} {list(flag.shape)}")
    set_condition_kernel().launch(1, 1, [ctypes.c_uint64(int(handle)), flag.contiguous()])


def set_condition_kernel() -> Kernel:
    """The compiled `set_condition` kernel (compile it before creating a handle: a handle left without a node
    makes the whole graph fail to instantiate)."""
    from tendril.cuda.nvrtc import compile_kernel

    return compile_kernel(_SET_CONDITION_SOURCE, "tendril_set_condition")


def add_conditional_node(
    info: CaptureInfo, handle: Any, kind: ConditionalKind, branches: int = 1
) -> tuple[Any, list[Any]]:
    """Add an IF (`branches` 1 or 2: then, else) or WHILE node after `info`'s current nodes.

    Returns the node and its body graphs, which CUDA creates empty and owns.
    """
    from cuda.bindings import runtime

    if kind is ConditionalKind.WHILE and branches != 1:
        raise ValueError("a WHILE node has exactly one body graph")
    if kind is ConditionalKind.IF and branches not in (1, 2):
        raise ValueError("an IF node has one (then) or two (then, else) body graphs")
    params = runtime.cudaGraphNodeParams()
    params.type = runtime.cudaGraphNodeType.cudaGraphNodeTypeConditional
    params.conditional.handle = handle
    params.conditional.type = (
        runtime.cudaGraphConditionalNodeType.cudaGraphCondTypeWhile
        if kind is ConditionalKind.WHILE
        else runtime.cudaGraphConditionalNodeType.cudaGraphCondTypeIf
    )
    params.conditional.size = branches
    deps = info.dependencies
    edge_data = info.edge_data if len(info.edge_data) == len(deps) and deps else None

    def add() -> Any:
        if _takes_edge_data(runtime.cudaGraphAddNode):
            return runtime.cudaGraphAddNode(info.graph, deps, edge_data, len(deps), params)
        return runtime.cudaGraphAddNode(info.graph, deps, len(deps), params)

    result = add()
    if int(result[0]) != 0 and hasattr(runtime, "cudaDeviceGetExecutionCtx"):
        # CUDA 13 drivers may want the node to name the execution context it runs in
        params.conditional.ctx = check(
            runtime.cudaDeviceGetExecutionCtx(torch.cuda.current_device()), "cudaDeviceGetExecutionCtx"
        )
        result = add()
    node = check(result, "cudaGraphAddNode(conditional)")
    bodies = list(params.conditional.phGraph_out)[:branches]
    return node, bodies


def set_capture_dependencies(stream: torch.cuda.Stream, nodes: Sequence[Any]) -> None:
    """Make `nodes` the only dependencies of the next operation captured on `stream`."""
    from cuda.bindings import runtime

    flags = runtime.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamSetCaptureDependencies
    update = runtime.cudaStreamUpdateCaptureDependencies
    if _takes_edge_data(update):
        result = update(stream.cuda_stream, list(nodes), None, len(nodes), flags)
    else:
        result = update(stream.cuda_stream, list(nodes), len(nodes), flags)
    check(result, "cudaStreamUpdateCaptureDependencies")


def _takes_edge_data(binding: Any) -> bool:
    """Whether a cuda-python graph binding has CUDA 13's edge-data parameter (12.x's plain form lacks it)."""
    signature = (binding.__doc__ or "").split("\n", 1)[0]
    return "dependencyData" in signature


def private_stream(device: int) -> torch.cuda.Stream:
    """A new non-blocking CUDA stream of `device` that no one else is handed.

    `torch.cuda.Stream()` hands out streams round robin from a pool of 32 per device, so two of them can be
    one CUDA stream: a stream kept for capturing loop bodies could then be the very stream some other
    capture begins on (cudaErrorIllegalState). The stream lives as long as the process."""
    from cuda.bindings import runtime

    with torch.cuda.device(device):
        handle = check(runtime.cudaStreamCreateWithFlags(runtime.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
    return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", device))


@contextlib.contextmanager
def capture_to_graph(stream: torch.cuda.Stream, graph: Any) -> Iterator[None]:
    """Record what is enqueued on `stream` into `graph` (a conditional body), in thread-local capture mode.

    Does not make `stream` torch's current stream; the caller does. If the body raises, the capture is
    ended and the original error propagates.
    """
    from cuda.bindings import runtime

    check(
        runtime.cudaStreamBeginCaptureToGraph(
            stream.cuda_stream,
            graph,
            None,
            None,
            0,
            runtime.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal,
        ),
        "cudaStreamBeginCaptureToGraph",
    )
    try:
        yield
    except BaseException:
        runtime.cudaStreamEndCapture(stream.cuda_stream)  # the body's own error is the one to report
        raise
    check(runtime.cudaStreamEndCapture(stream.cuda_stream), "cudaStreamEndCapture(conditional body)")


def count_nodes(graph: Any) -> int:
    """How many nodes `graph` holds at its top level (for tests and diagnostics)."""
    from cuda.bindings import runtime

    _, count = check(runtime.cudaGraphGetNodes(graph, 0), "cudaGraphGetNodes")
    return int(count)
