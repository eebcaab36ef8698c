"""Whether torch.compile's `mode="reduce-overhead"` really ran CUDA graphs: Inductor skips them for some graphs
(CPU tensors, mutated inputs, dynamic shapes past its limits) and then runs its kernels unrecorded, which changes
what a benchmark against it measures. `watch()` reports the skips made inside its block and their reasons."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch


class _Keep(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(level=logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


@contextlib.contextmanager
def watch() -> Iterator[dict[str, Any]]:
    """Yield a dict that, once the block ends, holds `skips` (Inductor's `cudagraph_skips` counter's growth) and
    `reasons` (the skip messages Inductor logged for CUDA graphs; it logs none for CPU-only graphs)."""
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_utils

    reasons: list[str] = []
    report: dict[str, Any] = {"skips": 0, "reasons": reasons}
    handler = _Keep(reasons)
    before = counters["inductor"]["cudagraph_skips"]
    torch._logging.set_logs(cudagraphs=True)
    cudagraph_utils.cudagraphs_log.addHandler(handler)
    try:
        yield report
    finally:
        cudagraph_utils.cudagraphs_log.removeHandler(handler)
        torch._logging.set_logs()
        report["skips"] = counters["inductor"]["cudagraph_skips"] - before
