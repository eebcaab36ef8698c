"""The CUDA backend: every graph of a callable captured into one shared private pool per device.

Capture goes through `tendril.graphs.capture.capture` on one capture stream per device; after
capture the outputs are released to the pool (`memory.release_outputs`) so the next capture reuses
their memory too. A failed capture leaves its blocks free in the pool for the next capture; if no
graph holds the pool yet, the pool itself is dropped and its memory returned to the device.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from tendril.graphs.backend import Captured, classify_capture_error
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS, HOST_COPY_ERROR, capture
from tendril.graphs.key import GraphKey
from tendril.graphs.memory import release_outputs
from tendril.graphs.stats import Fallback


class CudaBackend:
    """Captures on CUDA. `sdpa_backends`: attention kernels to capture with (`capture.GRAPH_SDPA_BACKENDS` by
    default, leaving out cuDNN attention's per-shape host planning; None keeps PyTorch's choice)."""

    def __init__(self, sdpa_backends: Sequence[SDPBackend] | None = GRAPH_SDPA_BACKENDS) -> None:
        self.sdpa_backends = sdpa_backends
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
            graph = None
            failure = None
            for pin_host_copies in (False, True):
                if device not in self._pools:  # a fresh handle: a pool no graph holds any more is not reused
                    self._pools[device] = torch.cuda.graph_pool_handle()
                    self._streams.setdefault(device, torch.cuda.Stream(device))
                try:
                    graph = capture(
                        fn,
                        *args,
                        pool=self._pools[device],
                        warmup=warmup,
                        stream=self._streams[device],
                        pin_host_copies=pin_host_copies,
                        sdpa_backends=self.sdpa_backends,
                        **kwargs,
                    )
                    break
                except Exception as error:  # classified, and the traceback (holding pool tensors) dropped
                    failure = classify_capture_error(error)
                    retry = HOST_COPY_ERROR in str(error)
                self._after_failure(device)
                if not retry:
                    break
            if graph is None:
                assert failure is not None
                raise failure
        outputs = release_outputs(graph.outputs)
        graph.outputs = None
        self._graphs_per_device[device] = self._graphs_per_device.get(device, 0) + 1
        self._pool_growth[device] = self._pool_growth.get(device, 0) + graph.pool_growth_bytes
        host_buffers = graph.host_buffers
        replay = graph.graph.replay
        if host_buffers:

            def replay() -> None:  # keeps the pinned host buffers alive as long as the graph
                assert host_buffers
                graph.graph.replay()

        return Captured(
            replay, outputs, graph.capture_ms, graph.pool_growth_bytes, graph.driver_bytes, graph.phases_ms
        )

    def _after_failure(self, device: torch.device) -> None:
        """Return a failed capture's memory: to the pool if graphs hold it, else to the device."""
        gc.collect()
        if self._graphs_per_device.get(device, 0) == 0:
            self._pools.pop(device, None)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        return sum(self._pool_growth.values())

