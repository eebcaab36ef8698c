"""The CUDA backend: every graph of a callable captured into one shared private pool per device.

Capture goes through `tendril.graphs.capture.capture` on one capture stream per device; after
capture the outputs are released to the pool (`memory.release_outputs`) so the next capture reuses
their memory too. A failed capture leaves its blocks free in the pool for the next capture; if no
graph holds the pool yet, the pool itself is dropped and its memory returned to the device.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from tendril.graphs.backend import Captured, classify_capture_error
from tendril.graphs.capture import capture
from tendril.graphs.key import GraphKey
from tendril.graphs.memory import release_outputs
from tendril.graphs.stats import Fallback


class CudaBackend:
    def __init__(self) -> None:
        self._pools: dict[torch.device, Any] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._graphs_per_device: dict[torch.device, int] = {}
        self._pool_growth: dict[torch.device, int] = {}

    def unavailable(self) -> tuple[Fallback, str] | None:
        if not torch.cuda.is_available():
            return Fallback.NO_CUDA, "torch.cuda.is_available() is False"
        return None

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def capture(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: GraphKey, warmup: int
    ) -> Captured:
        devices = key.devices()
        device = next(iter(devices)) if devices else torch.device("cuda", torch.cuda.current_device())
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(device):
            pool = self._pools.setdefault(device, torch.cuda.graph_pool_handle())
            stream = self._streams.setdefault(device, torch.cuda.Stream(device))
            failure = None
            try:
                graph = capture(fn, *args, pool=pool, warmup=warmup, stream=stream, **kwargs)
            except Exception as error:  # classified, and the traceback (holding pool tensors) dropped
                failure = classify_capture_error(error)
            if failure is not None:
                self._after_failure(device)
                raise failure
        outputs = release_outputs(graph.outputs)
        graph.outputs = None
        self._graphs_per_device[device] = self._graphs_per_device.get(device, 0) + 1
        self._pool_growth[device] = self._pool_growth.get(device, 0) + graph.pool_growth_bytes
        return Captured(graph.graph.replay, outputs, graph.capture_ms, graph.pool_growth_bytes, graph.driver_bytes)

    def _after_failure(self, device: torch.device) -> None:
        """Return a failed capture's memory: to the pool if graphs hold it, else to the device."""
        gc.collect()
        if self._graphs_per_device.get(device, 0) == 0:
            self._pools.pop(device, None)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        return sum(self._pool_growth.values())

