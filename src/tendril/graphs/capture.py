"""Capture and replay of one CUDA graph: warm-up on a side stream, then capture into a memory pool.

The inputs given to `capture` become the graph's placeholders: replaying reads whatever they hold
then, and overwrites the returned outputs in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    outputs: Any
    """What the captured function returned; its tensors live in the graph's pool."""

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs


def capture(fn: Callable[..., Any], *args: Any, pool: Any = None, warmup: int = 2, **kwargs: Any) -> CapturedGraph:
    """Run `fn(*args, **kwargs)` `warmup` times on a side stream, then capture it as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = fn(*args, **kwargs)
    return CapturedGraph(graph, outputs)
