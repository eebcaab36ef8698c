"""The CUDA backend: every graph of a callable captured into one shared private pool per device.

Capture goes through `tendril.graphs.capture.capture` on one capture stream per device; after
capture the outputs are released to the pool (`memory.release_outputs`) so the next capture reuses
their memory too. A failed capture leaves its blocks free in the pool for the next capture; if no
graph holds the pool yet, the pool itself is dropped and its memory returned to the device.

Executables. Without a graph-memory budget (strategy `dedicated`) each graph is instantiated by torch at capture and
replayed with `CUDAGraph.replay`. Under a budget (`tendril.graphs.executables`) the captured graph stays on the host
(`keep_graph`) and an `ExecutableCache` per device gives it an executable on demand, instantiating, updating
(`cudaGraphExecUpdate`) or evicting through `tendril.cuda.graph_exec`; replays launch that executable on torch's
current stream. A managed graph runs as segments of consecutive nodes (`segment_sizes`: 16 nodes first, then
doubling up to 96), each its own executable (`ManagedGraph`, `ExecutableChain`), launched one after the other in the
stream: a call that switches updates segment k + 1 on the host while the GPU runs segment k
(`CudaExecutables.launch`). Segments cost driver memory (each executable has a share of its own), host memory (the
segments are clones of the captured graph: 1.5 MiB per GPT-2 forward graph, against 0.75 MiB whole) and capture time
(cutting takes two driver calls per node and segment). Under `lru` and `update` (the automatic strategy with a
budget) the cache also prefetches: after each launch it predicts the next call's key (`key.next_in_step`: lengths
growing or shrinking by a constant step) and `CudaExecutables` instantiates that graph's executable on one
background thread (under `update` without room, updates one of its family's instead), then uploads it
(`cudaGraphUpload`) in the stream of the call that predicted it, so the next call neither instantiates (1.34 ms on
the H200 for a GPT-2 forward) nor pays the first launch's upload (0.27 ms); evictions destroy in the background too
(0.25 ms). Under `update` it looks `PREFETCH_AHEAD` calls ahead, to instantiate a family's executables before a
growing pass enters it. Graphs that draw random numbers keep torch's dedicated
executable, because torch's replay advances the generator's seed and offset before each launch (a plain launch would
repeat the same numbers); they are counted against the budget.

Ordering of switches. All graphs of a callable share pool memory, placeholders and outputs, so a
launch must not overlap the previous one. Launches on one stream are ordered by the stream; when a
call comes on another stream than the previous launch, that stream first waits (on the device, through
an event) for the previous one, before the call copies its inputs into the placeholders. Updating or
destroying an executable is a host call that CUDA applies to later launches only, so it needs no wait
(see `tendril.cuda.graph_exec`).

The background thread. One worker per device (`ThreadPoolExecutor(max_workers=1)`, started at the first
background task, stopped by `close`) runs instantiations, updates and destructions in submission order,
with the device set and in CUDA's relaxed capture mode (so it cannot break a capture running elsewhere in
the process). A destruction waits (on the worker) for the executable's last launch: its event is taken from
the launching thread's table when the destruction is submitted, so a later executable that reuses the
handle value gets an event of its own. A background update waits for that event too, then updates and
uploads the executable (on the stream of the call that predicted it: ordered after that call's launch).
The cache never hands out an executable queued for destruction and waits for a prefetched (or
background-updated) one before its next launch, so an executable is never launched after its destruction
or during its update, nor destroyed or updated under a running launch. Captures wait for the worker to
finish (clean memory measurements, no instantiation competing with the capture). Results stay those of
dedicated executables: a prefetched executable is the instantiation of exactly its graph, or an update to
it that CUDA accepted (a refused one is destroyed and the graph instantiated on the calling thread).
"""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.nn.attention import SDPBackend

from tendril import config
from tendril.cuda import graph_exec
from tendril.cuda.graph_exec import UpdateOutcome
from tendril.graphs.backend import Captured, CaptureFailed, classify_capture_error
from tendril.graphs.capture import GRAPH_SDPA_BACKENDS, HOST_COPY_ERROR, CapturedGraph, capture
from tendril.graphs.executables import ExecutableCache, MemoryStrategy, resolve_strategy
from tendril.graphs.key import GraphKey, next_in_step
from tendril.graphs.memory import device_free_bytes, host_resident_bytes, parse_bytes, release_outputs
from tendril.graphs.stats import Fallback, GraphMemory


class CudaBackend:
    """Captures on CUDA. `sdpa_backends`: attention kernels to capture with (`capture.GRAPH_SDPA_BACKENDS` by
    default, leaving out cuDNN attention's per-shape host planning; None keeps PyTorch's choice).

    `graph_memory_budget` (bytes or a string such as "256MiB") bounds the driver memory of the executables
    (None: `tendril.settings.graph_memory_budget`, from TENDRIL_GRAPH_MEMORY_BUDGET);
    `graph_memory_strategy` is "auto", "dedicated", "lru" or "update" (`tendril.graphs.executables`);
    `graph_memory_prefetch=False` turns off prefetching the next call's executable under `lru` and `update` (to
    measure without it, or to keep every driver call on the calling thread)."""

    def __init__(
        self,
        sdpa_backends: Sequence[SDPBackend] | None = GRAPH_SDPA_BACKENDS,
        *,
        graph_memory_budget: int | str | None = None,
        graph_memory_strategy: MemoryStrategy | str = MemoryStrategy.AUTO,
        graph_memory_prefetch: bool = True,
    ) -> None:
        self.sdpa_backends = sdpa_backends
        if graph_memory_budget is None:
            graph_memory_budget = config.settings.graph_memory_budget
        self.graph_memory_budget = parse_bytes(graph_memory_budget)
        self.strategy = resolve_strategy(graph_memory_strategy, self.graph_memory_budget)
        self.prefetch = bool(graph_memory_prefetch)
        self._pools: dict[torch.device, Any] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
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
                if device not in self._pools:  # a fresh handle: a pool no graph holds any more is not reused
                    self._pools[device] = torch.cuda.graph_pool_handle()
                    self._streams.setdefault(device, torch.cuda.Stream(device))
                try:
                    graph = capture(
                        random_use if random_use is not None else fn,
                        *args,
                        pool=self._pools[device],
                        warmup=warmup,
                        stream=self._streams[device],
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
        return _ManagedReplay(self, cache, key, device, graph)

    def _cache(self, device: torch.device) -> ExecutableCache:
        cache = self._caches.get(device)
        if cache is None:
            cache = ExecutableCache(
                CudaExecutables(device),
                self.strategy,
                self.graph_memory_budget,
                predict_next=next_in_step if self.prefetch else None,
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

    def executable_caches(self) -> dict[torch.device, ExecutableCache]:
        """The executable cache of each device (empty under the dedicated strategy)."""
        return dict(self._caches)


PREFETCH_AHEAD = 3
"""Calls ahead the cache predicts (`ExecutableCache.ahead`): under `update` a family a growing pass enters short of
executables gets one instantiated up to two calls before the call that needs it. GPT-2's forward graphs below 160
tokens make 20 families, entered every few calls, and instantiating and uploading a chain on the worker takes longer
than a call there: predicting one call ahead, the calls entering a family waited for it (a scratch timeline of
`graphs-memory`'s growing pass, not committed). In `graphs-memory` the growing calls that waited for their prefetch
went from 366 (one call ahead, six equal segments) to 217."""

FIRST_SEGMENT_NODES = 16
"""Nodes in the first segment of a managed graph (`segment_sizes`): a switch exposes the update of this one, the
GPU waits for it."""
MAX_SEGMENT_NODES = 96
"""Most nodes in one segment: each segment's executable takes driver memory of its own, so segments are no smaller
than the overlap needs."""


def segment_sizes(nodes: int) -> tuple[int, ...]:
    """Node counts of a managed graph's segments (`ManagedGraph`): `FIRST_SEGMENT_NODES`, then each twice the one
    before up to `MAX_SEGMENT_NODES`; a last piece under half the one before it joins that one. A GPT-2 forward graph
    of 293 nodes runs as 16, 32, 64, 96 and 85 nodes: the GPU starts after a short first update, and a switch's host
    work on segment k + 1 stays under the GPU's on segment k. A scratch sweep of segment plans (not committed; GPT-2
    graphs of one family switched at every call) favoured this doubling over six equal segments; in `graphs-memory`
    Wav2Vec2-base's random order went from 1.075x to 1.03x a dedicated executable's with it, GPT-2's stayed within
    the spread of runs."""
    sizes: list[int] = []
    size = FIRST_SEGMENT_NODES
    left = nodes
    while left > 0:
        sizes.append(min(size, left))
        left -= sizes[-1]
        size = min(2 * size, MAX_SEGMENT_NODES)
    if len(sizes) >= 2 and 2 * sizes[-1] < sizes[-2]:
        last = sizes.pop()
        sizes[-1] += last
    return tuple(sizes)


class ManagedGraph:
    """A captured graph under the executable cache, cut into segments (`graph_exec.split`) of `sizes` nodes
    (`segment_sizes`), each with an executable of its own: a switch updates a segment right before launching it,
    so the host updates segment k + 1 while the GPU runs segment k (`CudaExecutables.launch`). Graphs that cannot
    be cut (see `split`) are one segment: the captured graph itself. Holds the torch graph (and its pool) alive;
    the segments are destroyed with this object."""

    def __init__(self, graph: torch.cuda.CUDAGraph, sizes: tuple[int, ...]) -> None:
        self.graph = graph
        raw = graph.raw_cuda_graph()
        made = graph_exec.split(raw, sizes)
        self.segments: tuple[int, ...] = tuple(made) if made else (raw,)
        if made:
            finalizer = weakref.finalize(self, _destroy_graphs, graph_exec.destroy_graph, tuple(made))
            finalizer.atexit = False  # at interpreter exit the CUDA context goes away with the graphs


def _destroy_graphs(destroy: Callable[[int], None], graphs: tuple[int, ...]) -> None:
    for graph in graphs:
        destroy(graph)


class ExecutableChain:
    """The executables of a `ManagedGraph`'s segments, launched in order in one stream: what the cache calls an
    executable. A segment CUDA refused to update is replaced by a fresh instantiation (`CudaExecutables.launch`)."""

    def __init__(self, segments: list[int]) -> None:
        self.segments = segments

    def __repr__(self) -> str:
        return f"ExecutableChain({len(self.segments)} segments)"


class CudaExecutables:
    """`ExecutableDriver` over cuda-python for the `ManagedGraph`s of one device, measuring driver memory around
    each instantiation made on the calling thread while the background thread is idle (cudaMemGetInfo sees the
    whole device, so concurrent background work would pollute it: such instantiations report None).

    An executable (`ExecutableChain`) is updated or destroyed only once its last launch has completed: an event
    recorded after every launch is waited for on the host when it has not completed yet (counted in `waits` on
    the calling thread, `background_waits` on the worker). CUDA documents both operations as safe on an
    executable still running; the wait makes "no update while a replay still uses the executable" hold by
    construction instead of by the driver's word. It is usually free: the executable switched or evicted is the
    least recently used. (It did not cure the illegal instruction that `update` caused on the H200; telling
    cluster dimensions apart in the topology digest did: see `tendril.graphs.executables`.) The `_async`
    operations run in order on one worker thread (see the module docstring).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.measured_total = 0
        self.waits = 0
        """Updates and destructions that waited on the calling thread for the executable's last launch."""
        self.background_waits = 0
        """Background updates and destructions that waited on the worker for the executable's last launch
        (worker-written)."""
        self.refused_segments = 0
        """Segments a switch at launch could not update and instantiated afresh."""
        self._launched: dict[ExecutableChain, torch.cuda.Event] = {}
        self._worker: ThreadPoolExecutor | None = None
        self._outstanding: list[Future[Any]] = []

    def launch(
        self, executable: ExecutableChain, stream: torch.cuda.Stream, switch_to: ManagedGraph | None = None
    ) -> UpdateOutcome:
        """Launch the segments in `stream`; with `switch_to`, first update each segment to that graph's, right
        before launching it. A refused segment is destroyed and instantiated from `switch_to`'s, so the launch
        runs `switch_to` whatever CUDA answers; the outcome names the first refusal. On the calling thread, with
        this driver's device current (`_ManagedReplay` makes it so)."""
        outcome = UpdateOutcome(True)
        if switch_to is not None:
            self._settle(executable)
        for index, segment in enumerate(executable.segments):
            if switch_to is not None:
                updated = graph_exec.update(segment, switch_to.segments[index])
                if not updated.ok:
                    outcome = outcome if not outcome.ok else updated
                    self.refused_segments += 1
                    graph_exec.destroy(segment)
                    segment = executable.segments[index] = graph_exec.instantiate(switch_to.segments[index])
            graph_exec.launch(segment, stream.cuda_stream)
        event = self._launched.get(executable)
        if event is None:
            event = self._launched[executable] = torch.cuda.Event()
        event.record(stream)
        return outcome

    def _settle(self, executable: ExecutableChain) -> None:
        event = self._launched.get(executable)
        if event is not None and not event.query():
            self.waits += 1
            event.synchronize()

    def instantiate(self, graph: ManagedGraph) -> tuple[ExecutableChain, int | None]:
        with torch.cuda.device(self.device):
            if self._background_busy():  # only this thread submits work: idle now means idle until we return
                return _instantiate(graph.segments), None
            free_before = device_free_bytes(self.device)
            executable = _instantiate(graph.segments)
            measured = max(free_before - device_free_bytes(self.device), 0)
        self.measured_total += measured
        return executable, measured

    def update(self, executable: ExecutableChain, graph: ManagedGraph) -> UpdateOutcome:
        self._settle(executable)
        with torch.cuda.device(self.device):
            return _update(executable, graph.segments)

    def destroy(self, executable: ExecutableChain) -> None:
        self._settle(executable)
        self._launched.pop(executable, None)
        with torch.cuda.device(self.device):
            _destroy(executable)

    def instantiate_async(
        self, graph: ManagedGraph, stream: torch.cuda.Stream | None
    ) -> Future[tuple[ExecutableChain, int | None]]:
        raw_stream = None if stream is None else stream.cuda_stream
        return self._submit(self._instantiate_and_upload, graph.segments, raw_stream)

    def update_async(
        self, executable: ExecutableChain, graph: ManagedGraph, stream: torch.cuda.Stream | None
    ) -> Future[UpdateOutcome]:
        """Update `executable` on the worker after its last launch, then upload it in `stream`. The last launch's
        event is read now and left in the table (the executable lives on): the cache launches it again only once
        this future has completed, so no launch records that event meanwhile."""
        event = self._launched.get(executable)
        return self._submit(
            self._update_and_upload, executable, graph.segments, event, None if stream is None else stream.cuda_stream
        )

    def destroy_async(self, executable: ExecutableChain) -> Future[None]:
        event = self._launched.pop(executable, None)  # taken now: the table holds live executables only
        return self._submit(self._destroy_after, executable, event)

    def close(self) -> None:
        """Finish the queued background work and stop the worker."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._outstanding.clear()

    # -- the worker ----------------------------------------------------------------------------------

    def _submit(self, task: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tendril-executables-{self.device}")
        future = self._worker.submit(task, *args)
        self._background_busy()  # drop finished futures
        self._outstanding.append(future)
        return future

    def _background_busy(self) -> bool:
        self._outstanding = [future for future in self._outstanding if not future.done()]
        return bool(self._outstanding)

    def _instantiate_and_upload(
        self, segments: tuple[int, ...], stream: int | None
    ) -> tuple[ExecutableChain, int | None]:
        with torch.cuda.device(self.device):
            _relax_this_thread()
            executable = _instantiate(segments)
            if stream is not None:
                try:
                    _upload(executable, stream)
                except BaseException:
                    _destroy(executable)
                    raise
        return executable, None  # unmeasured: the calling thread may allocate meanwhile

    def _update_and_upload(
        self,
        executable: ExecutableChain,
        segments: tuple[int, ...],
        last_launch: torch.cuda.Event | None,
        stream: int | None,
    ) -> UpdateOutcome:
        """Update after the last launch, then upload, so that the next launch does not upload the updated executable
        itself. On an error the executable is destroyed (the cache forgets it: nothing is left to leak)."""
        with torch.cuda.device(self.device):
            try:
                _relax_this_thread()
                self._wait_for(last_launch)
                outcome = _update(executable, segments)
                if outcome.ok and stream is not None:
                    _upload(executable, stream)
            except BaseException:
                _destroy(executable)
                raise
        return outcome

    def _destroy_after(self, executable: ExecutableChain, last_launch: torch.cuda.Event | None) -> None:
        with torch.cuda.device(self.device):
            _relax_this_thread()
            self._wait_for(last_launch)
            _destroy(executable)

    def _wait_for(self, last_launch: torch.cuda.Event | None) -> None:
        if last_launch is not None and not last_launch.query():
            self.background_waits += 1
            last_launch.synchronize()


def _instantiate(segments: tuple[int, ...]) -> ExecutableChain:
    made: list[int] = []
    try:
        for segment in segments:
            made.append(graph_exec.instantiate(segment))
    except BaseException:
        for handle in made:
            graph_exec.destroy(handle)
        raise
    return ExecutableChain(made)


def _update(executable: ExecutableChain, segments: tuple[int, ...]) -> UpdateOutcome:
    """Update every segment; stops at the first refusal (the cache then destroys the executable)."""
    for handle, segment in zip(executable.segments, segments, strict=True):
        outcome = graph_exec.update(handle, segment)
        if not outcome.ok:
            return outcome
    return UpdateOutcome(True)


def _upload(executable: ExecutableChain, stream: int) -> None:
    for handle in executable.segments:
        graph_exec.upload(handle, stream)


def _destroy(executable: ExecutableChain) -> None:
    for handle in executable.segments:
        graph_exec.destroy(handle)


_worker_state = threading.local()


def _relax_this_thread() -> None:
    """Put the worker thread in CUDA's relaxed capture mode, once (in a task, so that a failure is the task's)."""
    if not getattr(_worker_state, "relaxed", False):
        graph_exec.relax_capture_mode()
        _worker_state.relaxed = True


class _ManagedReplay:
    """Replay of a graph whose executable the cache manages: acquire it, launch it on torch's current stream
    (already ordered after the previous launch by `_OrderAfterPrevious`), then let the cache prefetch the
    executable the next call is predicted to need. Holds the captured graph (and its pinned host buffers)
    alive."""

    def __init__(
        self, backend: CudaBackend, cache: ExecutableCache, key: GraphKey, device: torch.device, graph: CapturedGraph
    ) -> None:
        if not isinstance(cache.driver, CudaExecutables):
            raise TypeError(f"a CUDA replay needs CudaExecutables, got {type(cache.driver).__name__}")
        self._backend = backend
        self._cache = cache
        self._key = key
        self._device = device
        self._graph = graph

    def __call__(self) -> None:
        if torch.cuda.current_device() != self._device.index:
            with torch.cuda.device(self._device):
                self()
            return
        stream = torch.cuda.current_stream(self._device)
        self._cache.launch(self._key, stream)
        self._cache.prefetch_next(stream)


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


__all__ = ["CaptureFailed", "CudaBackend", "CudaExecutables", "ExecutableChain", "ManagedGraph"]
