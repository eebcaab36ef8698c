"""Lowering of `cond` / `while_loop` to CUDA conditional nodes inside a running stream capture.

The caller's stream is being captured (by `torch.cuda.graph`, `tendril.graphed`, or an enclosing
tendril body). The node is spliced into that capture: the predicate is computed and copied into a
conditional handle by captured kernels, the IF/WHILE node is added after the stream's current
nodes, each body is captured into the node's body graph on a side stream, and the caller's stream
then continues after the node. So loops and conds nest, and compose with any captured code.

Memory. Tensors that must outlive a body (loop state, branch outputs) are allocated on the caller's
stream, so they belong to the caller's graph pool and keep fixed addresses. Temporaries a body
allocates come from a body pool: a private torch graph pool per nesting depth per outermost
capture (PyTorch forbids recording into a pool that an active capture is recording into). Body
pools are never released, because they must outlive every replay of the graph and PyTorch does not
say when the graph is destroyed; they hold only the bodies' scratch memory. `body_pool_count()`
says how many exist.

Host syncs. A body runs with `torch.cuda.set_sync_debug_mode("error")`, so `.item()`, `.cpu()`,
`bool(tensor)` and the like raise at the offending call instead of invalidating the capture, and
the error is re-raised naming the function and the line.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tendril.cuda import graph_nodes
from tendril.cuda.nvrtc import relaxed_capture_mode


class HostSyncInGraphError(RuntimeError):
    """A function captured into a conditional body synchronised with the host."""


@dataclass
class _ThreadState:
    depth: int = 0
    root_capture_id: int = 0
    streams: dict[tuple[int, int], torch.cuda.Stream] = field(default_factory=dict)


_local = threading.local()
_pools: dict[tuple[int, int, int], Any] = {}
_pools_lock = threading.Lock()


def body_pool_count() -> int:
    """How many body memory pools this process holds (one per nesting depth per outermost capture)."""
    return len(_pools)


def _state() -> _ThreadState:
    state = getattr(_local, "state", None)
    if state is None:
        state = _local.state = _ThreadState()
    return state


def _side_stream(device: int, depth: int) -> torch.cuda.Stream:
    state = _state()
    stream = state.streams.get((device, depth))
    if stream is None:
        with relaxed_capture_mode():  # creating a stream is not capturable in the default mode
            stream = state.streams[(device, depth)] = graph_nodes.private_stream(device)
    return stream


def _body_pool(device: int, root_capture_id: int, depth: int) -> Any:
    with _pools_lock:
        key = (device, root_capture_id, depth)
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = torch.cuda.graph_pool_handle()
        return pool


@contextlib.contextmanager
def _allocate_to_pool(device: int, pool: Any) -> Iterator[None]:
    """Route allocations on torch's current stream (or, on older torch, this thread) to `pool`."""
    begin = getattr(torch._C, "_cuda_beginAllocateCurrentStreamToPool", None)
    if begin is None:
        begin = torch._C._cuda_beginAllocateCurrentThreadToPool
    begin(device, pool)
    try:
        yield
    finally:
        torch._C._cuda_endAllocateToPool(device, pool)


@dataclass(frozen=True)
class Splice:
    """A conditional node added to the caller's capture, with the body graphs still to be captured."""

    handle: Any
    node: Any
    bodies: list[Any]


def add_node(pred: torch.Tensor, kind: graph_nodes.ConditionalKind, branches: int) -> Splice:
    """Copy `pred` into a new conditional handle, then add an IF/WHILE node after it on the current stream."""
    stream = torch.cuda.current_stream()
    info = graph_nodes.capture_info(stream)
    if info is None:
        raise RuntimeError("internal: add_node called outside a stream capture")
    state = _state()
    if state.depth == 0:
        state.root_capture_id = info.capture_id
    graph_nodes.set_condition_kernel()
    handle = graph_nodes.create_conditional_handle(info.graph)
    graph_nodes.set_condition(handle, pred)
    info = graph_nodes.capture_info(stream)
    assert info is not None
    node, bodies = graph_nodes.add_conditional_node(info, handle, kind, branches)
    graph_nodes.set_capture_dependencies(stream, [node])
    return Splice(handle, node, bodies)


@contextlib.contextmanager
def capture_body(body_graph: Any, fn: Callable[..., Any], what: str) -> Iterator[None]:
    """Capture what runs inside the block into `body_graph`, on a side stream, with temporaries in a body pool.

    `fn` and `what` name the user function being captured, for error messages.
    """
    device = torch.cuda.current_device()
    state = _state()
    depth = state.depth + 1
    side = _side_stream(device, depth)
    pool = _body_pool(device, state.root_capture_id, depth)
    state.depth = depth
    try:
        with (
            torch.cuda.stream(side),
            _allocate_to_pool(device, pool),
            graph_nodes.capture_to_graph(side, body_graph),
            host_sync_guard(fn, what),
        ):
            yield
    finally:
        state.depth = depth - 1


@contextlib.contextmanager
def host_sync_guard(fn: Callable[..., Any], what: str) -> Iterator[None]:
    """Make host syncs in the block raise at once (sync debug mode "error"), reported as `HostSyncInGraphError`."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():  # torch warns that the mode is a prototype; it is only our guard here
        warnings.simplefilter("ignore", UserWarning)
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    except RuntimeError as exc:
        if _is_host_sync(exc) and not isinstance(exc, HostSyncInGraphError):
            raise HostSyncInGraphError(_host_sync_message(fn, what, exc)) from exc
        raise
    finally:
        torch.cuda.set_sync_debug_mode(previous)


_SYNC_MARKERS = ("synchronizing CUDA operation", "operation not permitted when stream is capturing", "StreamCapture")


_INTERNAL = ("/torch/", "/tendril/graphs/control", "/tendril/cuda/", "contextlib.py")


def _is_host_sync(exc: BaseException) -> bool:
    return any(marker in str(exc) for marker in _SYNC_MARKERS)


def _host_sync_message(fn: Callable[..., Any], what: str, exc: BaseException) -> str:
    name = getattr(fn, "__qualname__", repr(fn))
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not any(p in f.filename for p in _INTERNAL)]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({(frames[-1].line or '').strip()})" if frames else ""
    return (
        f"{what} {name!r} synchronised with the host{where} while being captured into a CUDA graph "
        f"conditional node. Host syncs (.item(), .cpu(), .tolist(), bool(tensor), `if tensor:`, printing a CUDA "
        f"tensor, ops with data-dependent output shapes such as nonzero) cannot run inside a graph: keep the value "
        f"on the device (torch.where, tendril.cond). Original error: {exc}"
    )
