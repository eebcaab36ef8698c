"""The CUDA side of the executable cache: managed graphs cut into segments, their executables, the worker thread.

A managed graph runs as segments of consecutive nodes (`segment_sizes`), each its own executable (`ManagedGraph`,
`ExecutableChain`), launched one after the other in the stream: a call that switches updates segment k + 1 on the
host while the GPU runs segment k (`CudaExecutables.launch`). Segments cost driver memory (each executable has a
share of its own), host memory (the segments are clones of the captured graph) and capture time (cutting takes
driver calls per node and segment), so they are no smaller than the overlap needs.

The background thread. One worker per device (`ThreadPoolExecutor(max_workers=1)`, started at the first background
task, stopped by `close`) runs instantiations, updates and destructions in submission order, with the device set
and in CUDA's relaxed capture mode (so it cannot break a capture running elsewhere in the process). A destruction
waits (on the worker) for the executable's last launch: its event is taken from the launching thread's table when
the destruction is submitted, so a later executable that reuses the handle value gets an event of its own. A
background update waits for that event too, then updates and uploads the executable (on the stream of the call that
predicted it: ordered after that call's launch). Since the worker runs in order, a prefetch queued behind the
destruction or update of an executable whose launch is still running waits for that launch.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from tendril.cuda import graph_exec
from tendril.cuda.graph_exec import UpdateOutcome
from tendril.graphs.memory import device_free_bytes

if TYPE_CHECKING:
    from tendril.graphs.capture import CapturedGraph
    from tendril.graphs.executables.policy import ExecutableCache
    from tendril.graphs.key import GraphKey

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
    work on segment k + 1 stays under the GPU's on segment k (doubling did better than equal segments)."""
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
    least recently used. The `_async` operations run in order on one worker thread (see the module docstring).
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
        this driver's device current (`ManagedReplay` makes it so)."""
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


class ManagedReplay:
    """Replay of a graph whose executable the cache manages: acquire it, launch it on torch's current stream
    (already ordered after the previous launch by the backend), then let the cache prefetch the executable the next
    call is predicted to need. Holds the captured graph (and its pinned host buffers) alive, and `owner` (the
    backend, whose finalizer closes the cache)."""

    def __init__(
        self, owner: object, cache: ExecutableCache, key: GraphKey, device: torch.device, graph: CapturedGraph
    ) -> None:
        if not isinstance(cache.driver, CudaExecutables):
            raise TypeError(f"a CUDA replay needs CudaExecutables, got {type(cache.driver).__name__}")
        self._owner = owner
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
