"""The CUDA backend: every graph of a callable captured into one shared private pool per device.

Capture goes through `tendril.graphs.capture.capture` on one capture stream per device; after capture the outputs
are released to the pool (`memory.release_outputs`) so the next capture reuses their memory too. A failed capture
leaves its blocks free in the pool for the next capture; if no graph holds the pool yet, the pool itself is dropped
and its memory returned to the device.

Executables. Under the `dedicated` strategy each graph is instantiated by torch at capture and replayed with
`CUDAGraph.replay`. Otherwise (a `GraphMemoryPolicy` with a budget, or strategy `update`) the captured graph stays on
the host and an `ExecutableCache` per device gives it an executable on demand (`tendril.graphs.executables`), with
prefetching unless the policy turns it off; replays launch that executable on torch's current stream. Graphs that
draw random numbers keep torch's dedicated executable, because torch's replay advances the generator's seed and
offset before each launch (a plain launch would repeat the same numbers); they are counted against the budget.

Ordering of launches. All graphs of a callable share pool memory, placeholders and outputs, so a launch must not
overlap the previous one. Launches on one stream are ordered by the stream; when a call comes on another stream
than the previous launch, that stream first waits (on the device, through an event) for the previous one, before
the call copies its inputs into the placeholders. Updating or destroying an executable is a host call that CUDA
applies to later launches only, so it needs no wait (see `tendril.cuda.graph_exec`). Captures wait for the
executables' background work to finish (clean memory measurements, no instantiation competing with the capture).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from tendril import config
from tendril.cuda import graph_exec
from tendril.graphs.backend import Captured, CaptureFailed, classify_capture_error
from tendril.graphs.capture import (
    GRAPH_SDPA_BACKENDS,
    HOST_COPY_ERROR,
    CapturedGraph,
    accepts_captures,
    capture,
    capture_stream,
)
from tendril.graphs.executables import PREFETCH_AHEAD, ExecutableCache
from tendril.graphs.executables.cuda import CudaExecutables, ManagedGraph, ManagedReplay, segment_sizes
from tendril.graphs.key import GraphKey, next_in_step
from tendril.graphs.memory import device_free_bytes, host_resident_bytes, release_outputs
from tendril.graphs.options import GraphMemoryPolicy, MemoryStrategy
from tendril.graphs.stats import Fallback, GraphMemory


class CudaBackend:
    """Captures on CUDA. `sdpa_backends`: attention kernels to capture with (`capture.GRAPH_SDPA_BACKENDS` by
    default, leaving out cuDNN attention's per-shape host planning; None keeps PyTorch's choice, as the default backend
    of `tendril.graphed(compile=...)` does).

    `memory`: how the executables are kept (budget, strategy, prefetching); None is `GraphMemoryPolicy()`. Either way
    the process default budget (`tendril.config.settings.graph_memory_budget`, from TENDRIL_GRAPH_MEMORY_BUDGET) fills
    in where the policy names none."""

    def __init__(
        self,
        sdpa_backends: Sequence[SDPBackend] | None = GRAPH_SDPA_BACKENDS,
        *,
        memory: GraphMemoryPolicy | None = None,
    ) -> None:
        self.sdpa_backends = sdpa_backends
        self.memory = (memory if memory is not None else GraphMemoryPolicy()).with_default_budget(config.settings)
        self.strategy = self.memory.resolved
        self._pools: dict[torch.device, Any] = {}
        self._graphs_per_device: dict[torch.device, int] = {}
        self._pool_growth: dict[torch.device, int] = {}
        self._caches: dict[torch.device, ExecutableCache] = {}
        self._last_stream: dict[torch.device, torch.cuda.Stream] = {}

    def unavailable(self) -> tuple[Fallback, str] | None:
        if not torch.cuda.is_available():
            return Fallback.NO_CUDA, "torch.cuda.is_available() is False"
        return None

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cuda"

    @property
    def managed(self) -> bool:
        """Whether executables are managed under a budget/strategy rather than kept one per graph by torch."""
        return self.strategy is not MemoryStrategy.DEDICATED

    def capture(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: GraphKey, warmup: int
    ) -> Captured:
        devices = key.devices()
        device = next(iter(devices)) if devices else torch.device("cuda", torch.cuda.current_device())
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(device):
            for cache in self._caches.values():
                cache.wait_idle()
            host_before = host_resident_bytes()
            random_use = _RandomUse(fn, device) if self.managed else None
            graph = None
            failure = None
            for pin_host_copies in (False, True):
                if device not in self._pools or not accepts_captures(self._pools[device]):
                    # fresh when no graph holds the pool (`_after_failure`) or a capture abandoned it
                    self._pools[device] = torch.cuda.graph_pool_handle()
                try:
                    graph = capture(
                        random_use if random_use is not None else fn,
                        *args,
                        pool=self._pools[device],
                        warmup=warmup,
                        stream=capture_stream(device),
                        pin_host_copies=pin_host_copies,
                        sdpa_backends=self.sdpa_backends,
                        instantiate=not self.managed,
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
            host_after = host_resident_bytes()
            memory = GraphMemory()
            if host_before is not None and host_after is not None:
                memory.host_bytes = max(host_after - host_before, 0)
            replay: Callable[[], None] = _torch_replay(graph)
            before_inputs = None
            if random_use is not None:
                before_inputs = _OrderAfterPrevious(self, device)
                try:
                    replay = self._manage(graph, key, device, random_use, memory)
                except Exception as error:
                    self._discard(key, device)
                    del graph
                    self._after_failure(device)
                    raise classify_capture_error(error) from None
        outputs = release_outputs(graph.outputs)
        graph.outputs = None
        self._graphs_per_device[device] = self._graphs_per_device.get(device, 0) + 1
        self._pool_growth[device] = self._pool_growth.get(device, 0) + graph.pool_growth_bytes
        return Captured(
            replay,
            outputs,
            graph.capture_ms,
            graph.pool_growth_bytes,
            graph.driver_bytes,
            graph.phases_ms,
            memory,
            before_inputs,
        )

    def _manage(
        self, graph: CapturedGraph, key: GraphKey, device: torch.device, random_use: _RandomUse, memory: GraphMemory
    ) -> Callable[[], None]:
        """Hand a graph captured without an executable to the device's cache (or to torch if it draws random
        numbers); return its replay. Instantiation time is added to the capture's phases."""
        cache = self._cache(device)
        if random_use.draws_random_numbers:
            memory.strategy = (
                "dedicated: draws random numbers (torch's replay advances the generator)"
                if random_use.checked
                else "dedicated: warmup=0 leaves no eager run to tell whether it draws random numbers"
            )
            free_before = device_free_bytes(device)
            graph.graph.instantiate()
            graph.driver_bytes = max(free_before - device_free_bytes(device), 0)
            cache.reserve(graph.driver_bytes)
            memory.executable_bytes = graph.driver_bytes
            memory.instantiations = 1
            return _torch_replay(graph)
        driver = cache.driver
        assert isinstance(driver, CudaExecutables)
        topology = graph_exec.topology(graph.graph.raw_cuda_graph())
        host_before = host_resident_bytes()
        managed = ManagedGraph(graph.graph, segment_sizes(topology.nodes))
        host_after = host_resident_bytes()
        if memory.host_bytes is not None and host_before is not None and host_after is not None:
            memory.host_bytes += max(host_after - host_before, 0)
        memory.segments = len(managed.segments)
        cache.add(key, managed, topology, memory)
        measured_before = driver.measured_total
        cache.acquire(key, call=False)  # instantiates (or switches) now: a graph that cannot run fails here
        graph.driver_bytes = driver.measured_total - measured_before
        graph.phases_ms["instantiate"] = memory.switch_ms
        memory.switch_ms = 0.0
        graph.capture_ms += graph.phases_ms["instantiate"]
        return ManagedReplay(self, cache, key, device, graph)

    def _cache(self, device: torch.device) -> ExecutableCache:
        cache = self._caches.get(device)
        if cache is None:
            cache = ExecutableCache(
                CudaExecutables(device),
                self.memory.budget,
                predict_next=next_in_step if self.memory.prefetch else None,
                ahead=PREFETCH_AHEAD,
            )
            self._caches[device] = cache
            finalizer = weakref.finalize(self, cache.close)
            finalizer.atexit = False  # at interpreter exit the CUDA context goes away with the executables
        return cache

    def _discard(self, key: GraphKey, device: torch.device) -> None:
        cache = self._caches.get(device)
        if cache is not None:
            cache.discard(key)

    def order_after_previous_launch(self, device: torch.device, stream: torch.cuda.Stream) -> None:
        """Make `stream` wait (on the device) for the previous launch of this backend's graphs on `device` when
        that went to another stream: graphs share pool memory, placeholders and outputs."""
        previous = self._last_stream.get(device)
        if previous is not None and previous != stream:
            stream.wait_stream(previous)
        self._last_stream[device] = stream

    def _after_failure(self, device: torch.device) -> None:
        """Return a failed capture's memory: to the pool if graphs hold it, else to the device."""
        gc.collect()
        if self._graphs_per_device.get(device, 0) == 0:
            self._pools.pop(device, None)
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()

    def pool_bytes(self) -> int:
        return sum(self._pool_growth.values())

    def forget_graphs(self) -> None:
        """Every graph was dropped (`Backend.forget_graphs`): their executables destroyed, no pool kept."""
        for cache in self._caches.values():
            cache.close()
        for table in (self._caches, self._pools, self._graphs_per_device, self._pool_growth, self._last_stream):
            table.clear()

    def executable_caches(self) -> dict[torch.device, ExecutableCache]:
        """The executable cache of each device (empty under the dedicated strategy)."""
        return dict(self._caches)


class _OrderAfterPrevious:
    """Run before a call's inputs are copied: the call's stream waits for the previous launch's stream."""

    def __init__(self, backend: CudaBackend, device: torch.device) -> None:
        self._backend = backend
        self._device = device

    def __call__(self) -> None:
        self._backend.order_after_previous_launch(self._device, torch.cuda.current_stream(self._device))


def _torch_replay(graph: CapturedGraph) -> Callable[[], None]:
    """torch's replay of a graph it instantiated; keeps pinned host buffers alive as long as the graph."""
    host_buffers = graph.host_buffers
    if not host_buffers:
        return graph.graph.replay

    def replay() -> None:
        assert host_buffers
        graph.graph.replay()

    return replay


class _RandomUse:
    """`fn`, noting whether its eager (warm-up) runs advance the device's default random-number generator."""

    def __init__(self, fn: Callable[..., Any], device: torch.device) -> None:
        self.fn = fn
        self.generator = torch.cuda.default_generators[device.index if device.index is not None else 0]
        self.readable = hasattr(self.generator, "get_offset")
        self.checked = False
        self.used = False

    @property
    def draws_random_numbers(self) -> bool:
        """True if a warm-up run drew random numbers, or if there was no warm-up run to tell (warmup=0)."""
        return self.used or not self.checked

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.readable or torch.cuda.is_current_stream_capturing():
            return self.fn(*args, **kwargs)
        before = self.generator.get_offset()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.used |= self.generator.get_offset() != before
            self.checked = True


__all__ = ["CaptureFailed", "CudaBackend"]
