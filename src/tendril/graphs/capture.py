"""Capture and replay of one CUDA graph: warm-up, capture into a memory pool, timed instantiation.

The inputs given to `capture` become the graph's placeholders: replaying reads whatever they hold
then, and overwrites the returned outputs in place.

Capture is split from instantiation (`CUDAGraph(keep_graph=True)`) so the device memory the driver
takes for the executable graph can be measured on its own, around `instantiate()`. Capture begins
and ends on the given stream directly rather than through `torch.cuda.graph`, whose entry
synchronises the device and empties the allocator's cache on every capture (costly when capturing
hundreds of shapes). Any work the function puts on the capturing stream is recorded, including
nodes added by other tendril modules (conditional nodes, child graphs), not only kernels.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tendril.graphs.memory import device_free_bytes, pool_reserved_bytes


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    outputs: Any
    """What the captured function returned; its tensors live in the graph's pool."""
    capture_ms: float = 0.0
    """Host time for warm-up, capture and instantiation."""
    pool_growth_bytes: int = 0
    """Bytes the allocator reserved while capturing (the pool's growth for this graph)."""
    driver_bytes: int = 0
    """Device memory the driver allocated while instantiating the executable graph."""

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs


def capture(
    fn: Callable[..., Any],
    *args: Any,
    pool: Any = None,
    warmup: int = 2,
    stream: torch.cuda.Stream | None = None,
    **kwargs: Any,
) -> CapturedGraph:
    """Run `fn(*args, **kwargs)` `warmup` times, then capture it as a CUDA graph and instantiate it.

    `pool` is a `torch.cuda.graph_pool_handle()` to share with other graphs (None: a private pool).
    Warm-up and capture run on `stream` (default: a new side stream), which first waits for the
    current stream; the current stream then waits for the capture. A function that fails while
    capturing (a host synchronisation, an operation that cannot be captured) ends the capture and
    re-raises; its tensors return to the pool when the exception is dropped.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    stream = torch.cuda.Stream() if stream is None else stream
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(*args, **kwargs)
        reserved_before = pool_reserved_bytes(device)
        if pool is None:
            graph.capture_begin(capture_error_mode="thread_local")
        else:
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            outputs = fn(*args, **kwargs)
        except BaseException:
            _abandon(graph)
            raise
        graph.capture_end()
    current.wait_stream(stream)
    pool_growth = pool_reserved_bytes(device) - reserved_before
    free_before = device_free_bytes(device)
    graph.instantiate()
    driver = free_before - device_free_bytes(device)
    elapsed_ms = (time.perf_counter() - start) * 1e3
    return CapturedGraph(graph, outputs, elapsed_ms, pool_growth, max(driver, 0))


def _abandon(graph: torch.cuda.CUDAGraph) -> None:
    """End a capture the function broke; the error it raised is the one worth reporting."""
    with contextlib.suppress(RuntimeError):
        graph.capture_end()
