"""`CudaBackend` under a graph-memory budget, end to end through `tendril.graphed`, on a simulated CUDA.

Capture, the cuda-python executable calls and torch's CUDA stream/device calls are replaced by fakes
that run the function on the CPU: a fake executable "runs" whichever captured graph it was last
instantiated or updated with. Everything else is the real code: the callable, the backend's managed
path (random-number check, topology families, the cache, ordering across streams, failure cleanup)
and the policy. Results must equal the function's under random call orders; the real CUDA calls run
in the GPU tests.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

from tendril.config import Config
from tendril.cuda.graph_exec import Topology, UpdateOutcome
from tendril.graphs import cuda_backend
from tendril.graphs.callable import graphed
from tendril.graphs.capture import CapturedGraph
from tendril.graphs.executables import cuda as executables_cuda
from tendril.graphs.options import GraphMemoryPolicy, MemoryStrategy
from tendril.graphs.stats import Fallback


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle
        self.waited_for: list[int] = []

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeStream) and other.cuda_stream == self.cuda_stream

    def __hash__(self) -> int:
        return self.cuda_stream

    def wait_stream(self, other: FakeStream) -> None:
        self.waited_for.append(other.cuda_stream)


class FakeEvent:
    """A CUDA event: "completes" unless the test says launches are still running (`FakeCuda.running`)."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.recorded_on: int | None = None

    def record(self, stream: FakeStream) -> None:
        self.recorded_on = stream.cuda_stream

    def query(self) -> bool:
        return not self.cuda.running

    def synchronize(self) -> None:
        self.cuda.synchronized += 1


class FakeGenerator:
    offset = 0

    def get_offset(self) -> int:
        return self.offset


class FakeCuda:
    """The simulated device: captured graphs by raw handle, executables by handle."""

    def __init__(self) -> None:
        self.graphs: dict[int, FakeGraph] = {}
        self.executables: dict[int, int] = {}
        self.launches: list[tuple[int, int]] = []
        self.uploads: list[tuple[int, int]] = []
        self.threads: set[str] = set()
        """Names of the threads that instantiated executables."""
        self.update_threads: set[str] = set()
        """Names of the threads that updated executables."""
        self.relaxed_threads: set[str] = set()
        self.fail_instantiate = False
        self.fail_upload = False
        self.running = False
        """Whether recorded events report their launch as still running."""
        self.family_per_shape = False
        """Whether every input shape makes a topology family of its own (else one per rank)."""
        self.synchronized = 0
        self.generator = FakeGenerator()
        self.streams = {0: FakeStream(0)}
        self.log: list[tuple[str, int]] = []
        """Updates and launches of executables, in order."""
        self.current = 0
        self._next = 1
        self._lock = threading.Lock()

    def handle(self) -> int:
        with self._lock:  # the worker thread instantiates too
            self._next += 1
            return self._next

    # graph_exec
    def instantiate(self, raw: int) -> int:
        if self.fail_instantiate:
            raise RuntimeError("cudaGraphInstantiateWithFlags failed: cudaErrorInvalidValue (1)")
        self.threads.add(threading.current_thread().name)
        executable = self.handle()
        self.executables[executable] = raw
        return executable

    def update(self, executable: int, raw: int) -> UpdateOutcome:
        self.update_threads.add(threading.current_thread().name)
        self.log.append(("update", executable))
        old, new = self.graphs[self.executables[executable]], self.graphs[raw]
        if old.topology != new.topology or new.refuse_updates:
            return UpdateOutcome(False, "cudaGraphExecUpdateErrorParametersChanged")
        self.executables[executable] = raw
        return UpdateOutcome(True)

    def upload(self, executable: int, stream: int) -> None:
        assert executable in self.executables
        if self.fail_upload:
            raise RuntimeError("cudaGraphUpload failed: cudaErrorIllegalAddress (700)")
        self.uploads.append((executable, stream))

    def relax_capture_mode(self) -> None:
        self.relaxed_threads.add(threading.current_thread().name)

    def launch(self, executable: int, stream: int) -> None:
        assert executable in self.executables, "launched a destroyed executable"
        self.launches.append((executable, stream))
        self.log.append(("launch", executable))
        self.graphs[self.executables[executable]].run()

    def destroy(self, executable: int) -> None:
        del self.executables[executable]

    def topology(self, raw: int) -> Topology:
        return self.graphs[raw].topology

    def split(self, raw: int, sizes: tuple[int, ...]) -> list[int] | None:
        assert sum(sizes) == self.graphs[raw].topology.nodes
        if len(sizes) < 2:
            return None
        return [FakeSegment(self, self.graphs[raw], index).raw for index in range(len(sizes))]

    def destroy_graph(self, raw: int) -> None:
        del self.graphs[raw]


class FakeSegment:
    """A segment of a `FakeGraph`: the first runs the function, the others nothing."""

    def __init__(self, cuda: FakeCuda, whole: FakeGraph, index: int) -> None:
        self.whole, self.index = whole, index
        self.raw = cuda.handle()
        cuda.graphs[self.raw] = self  # type: ignore[assignment]
        self.topology = Topology(whole.topology.nodes, f"{whole.topology.digest}/{index}")

    @property
    def refuse_updates(self) -> bool:
        return self.whole.refuse_updates

    def run(self) -> None:
        if self.index == 0:
            self.whole.run()


class FakeGraph:
    """A "captured graph": reruns the function on its placeholders into its outputs' storage."""

    def __init__(self, cuda: FakeCuda, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.cuda, self.fn, self.args, self.kwargs = cuda, fn, args, kwargs
        self.raw = cuda.handle()
        cuda.graphs[self.raw] = self
        self.outputs = pytree.tree_map_only(torch.Tensor, torch.clone, fn(*args, **kwargs))
        first = next(leaf for leaf in pytree.tree_leaves(args) if isinstance(leaf, torch.Tensor))
        family = f"shape{tuple(first.shape)}" if cuda.family_per_shape else f"rank{first.dim()}"
        self.topology = Topology(10 * first.dim(), family)
        self.refuse_updates = first.shape[0] == 7
        self.torch_instantiated = False

    def raw_cuda_graph(self) -> int:
        return self.raw

    def instantiate(self) -> None:
        self.torch_instantiated = True

    def replay(self) -> None:
        assert self.torch_instantiated
        self.run()

    def run(self) -> None:
        results = [leaf for leaf in pytree.tree_leaves(self.fn(*self.args, **self.kwargs)) if torch.is_tensor(leaf)]
        targets = [leaf for leaf in pytree.tree_leaves(self.outputs) if torch.is_tensor(leaf)]
        torch._foreach_copy_(targets, results)


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    fake = FakeCuda()

    def capture(fn: Any, *args: Any, warmup: int = 1, instantiate: bool = True, **kwargs: Any) -> CapturedGraph:
        for name in ("pool", "stream", "pin_host_copies", "sdpa_backends"):
            kwargs.pop(name, None)
        for _ in range(warmup):
            fn(*args, **kwargs)
        graph = FakeGraph(fake, fn, args, kwargs)
        if instantiate:
            graph.instantiate()
        return CapturedGraph(graph, graph.outputs, 1.0, 0, 0, {"warmup": 0.5, "record": 0.5})  # type: ignore[arg-type]

    monkeypatch.setattr(cuda_backend, "capture", capture)
    graph_exec = SimpleNamespace(
        instantiate=fake.instantiate,
        upload=fake.upload,
        relax_capture_mode=fake.relax_capture_mode,
        update=fake.update,
        launch=fake.launch,
        destroy=fake.destroy,
        topology=fake.topology,
        split=fake.split,
        destroy_graph=fake.destroy_graph,
    )
    for module in (cuda_backend, executables_cuda):
        monkeypatch.setattr(module, "graph_exec", graph_exec)
        monkeypatch.setattr(module, "device_free_bytes", lambda device: 1 << 40)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: fake.streams[fake.current])
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(99))
    monkeypatch.setattr(torch.cuda, "Event", lambda: FakeEvent(fake))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 1))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "default_generators", (fake.generator,))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return fake


class CpuAsCuda(cuda_backend.CudaBackend):
    """The CUDA backend, taking CPU tensors as graph inputs (the device calls are simulated)."""

    def accepts(self, device: torch.device) -> bool:
        return device.type == "cpu"


def _graphed(fn: Any, budget: str | None, strategy: str = "auto", prefetch: bool = True) -> Any:
    policy = GraphMemoryPolicy(budget=budget, strategy=strategy, prefetch=prefetch)  # type: ignore[arg-type]
    backend = CpuAsCuda(memory=policy)
    return graphed(fn, backend=backend, config=Config(), max_graphs=64)


def _scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor + 1


@pytest.mark.parametrize("strategy", ["auto", "update"])
def test_random_call_orders_match_the_function(cuda: FakeCuda, strategy: str):
    fast = _graphed(_scale, "2KiB", strategy)  # at most a few executables: switching all the time
    rng = random.Random(0)
    for _ in range(120):
        shape = rng.choice([(3,), (5,), (7,), (2, 3), (4, 3)])
        factor = rng.choice([2.0, 3.0])
        x = torch.randn(shape)
        got = fast(x, factor)
        torch.testing.assert_close(got, _scale(x, factor))
        got.fill_(float("nan"))
    memory = [record.memory for record in fast.stats.graphs.values()]
    assert fast.stats.captures == 10 and not fast.stats.fallbacks
    assert all(m.strategy == "update" for m in memory)
    assert sum(m.instantiations + m.updates for m in memory) > 10, "no switching happened"
    cache = next(iter(fast._backend.executable_caches().values()))
    cache.wait_idle()  # background destructions may still be queued
    assert len(cuda.executables) == cache.executables
    assert sum(m.updates for m in memory) > 0
    assert sum(m.update_failures for m in memory) > 0  # shape (7,) refuses updates: counted, re-instantiated


def test_without_a_budget_graphs_stay_dedicated_and_torch_replays_them(cuda: FakeCuda):
    fast = _graphed(_scale, None)
    x = torch.randn(4)
    torch.testing.assert_close(fast(x, 2.0), _scale(x, 2.0))
    torch.testing.assert_close(fast(x, 2.0), _scale(x, 2.0))
    assert not cuda.executables and not cuda.launches
    (record,) = fast.stats.graphs.values()
    assert record.memory.strategy == "dedicated"


def test_a_call_on_another_stream_waits_for_the_previous_launch(cuda: FakeCuda):
    fast = _graphed(_scale, "1MiB", "update")
    x = torch.randn(4)
    fast(x, 2.0)
    cuda.streams[5] = FakeStream(5)
    cuda.current = 5
    fast(x, 3.0)
    fast(x, 2.0)
    assert cuda.streams[5].waited_for == [0]  # once, when the stream changed
    assert [stream for _, stream in cuda.launches][-2:] == [5, 5]


def test_updates_and_evictions_wait_for_the_executables_last_launch(cuda: FakeCuda):
    """An executable whose last launch has not completed is waited for before it is switched or destroyed;
    one whose launch completed is not. (A budget smaller than one executable: every switch is an update.)"""
    fast = _graphed(_scale, "1KiB", "update")
    x = torch.randn(4)
    fast(x, 2.0)
    fast(x, 3.0)  # the launch of 2.0 completed: the update does not wait
    driver = next(iter(fast._backend.executable_caches().values())).driver
    assert driver.waits == 0 and cuda.synchronized == 0
    cuda.running = True
    fast(x, 2.0)
    fast(x, 3.0)
    torch.testing.assert_close(fast(x, 2.0), _scale(x, 2.0))
    assert driver.waits == 3 and cuda.synchronized == 3


def test_graphs_drawing_random_numbers_keep_torchs_replay(cuda: FakeCuda):
    def noisy(x: torch.Tensor) -> torch.Tensor:
        cuda.generator.offset += 4  # what a random op does to the generator when run eagerly
        return x + 1

    fast = _graphed(noisy, "1MiB", "update")
    x = torch.randn(4)
    torch.testing.assert_close(fast(x), x + 1)
    (record,) = fast.stats.graphs.values()
    assert record.memory.strategy.startswith("dedicated: draws random numbers")
    assert not cuda.executables and not cuda.launches


def test_a_graph_that_cannot_be_instantiated_runs_eagerly(cuda: FakeCuda):
    fast = _graphed(_scale, "1MiB", "update")
    cuda.fail_instantiate = True
    x = torch.randn(4)
    with pytest.warns(UserWarning, match="capturing raised an error"):
        torch.testing.assert_close(fast(x, 2.0), _scale(x, 2.0))
    assert fast.stats.fallbacks[Fallback.CAPTURE_ERROR] == 1 and not fast.stats.graphs
    cache = next(iter(fast._backend.executable_caches().values()))
    assert cache.executables == 0 and not cache.table.sources


def test_the_default_budget_comes_from_the_settings(monkeypatch):
    from tendril import config

    monkeypatch.setattr(config, "settings", Config(graph_memory_budget="3MiB"))
    assert cuda_backend.CudaBackend().memory.budget == 3 << 20
    assert cuda_backend.CudaBackend().strategy is MemoryStrategy.UPDATE
    assert cuda_backend.CudaBackend(memory=GraphMemoryPolicy(budget=1024)).memory.budget == 1024
    given = GraphMemoryPolicy(strategy=MemoryStrategy.UPDATE, prefetch=False)
    assert cuda_backend.CudaBackend(memory=given).memory == GraphMemoryPolicy(3 << 20, MemoryStrategy.UPDATE, False)
    dedicated = GraphMemoryPolicy(strategy=MemoryStrategy.DEDICATED)
    assert cuda_backend.CudaBackend(memory=dedicated).memory.budget is None  # dedicated holds no budget
    monkeypatch.setattr(config, "settings", Config(graph_memory_budget="lots"))
    with pytest.raises(ValueError, match="'lots' as a memory size"):
        cuda_backend.CudaBackend()


def _first(x: torch.Tensor) -> torch.Tensor:
    return x[:1] * 3 + x.sum()


def _grow_and_shrink(fast: Any, lengths: range) -> None:
    """Call `fast` (graphing `_first`) at `lengths` growing, then shrinking, twice; each result checked against the
    function, then poisoned (the next replay of its graph must overwrite it)."""
    for _ in range(2):
        for n in [*lengths, *reversed(lengths)]:
            x = torch.randn(n)
            got = fast(x)
            torch.testing.assert_close(got, _first(x))
            got.fill_(float("nan"))


@pytest.mark.parametrize("prefetch", [True, False])
def test_growing_lengths_are_prefetched_on_the_worker_thread(cuda: FakeCuda, prefetch: bool):
    fast = _graphed(_first, "2KiB", "auto", prefetch)  # executables of 10 nodes, charged 40 KiB: one fits
    fast.capture([(torch.randn(n),) for n in range(1, 31)], progress=False)
    cache = next(iter(fast._backend.executable_caches().values()))
    cache.accounting.budget = 3 * cache.accounting.charge(
        10
    )  # room for the executable just called, a prefetch and one more
    cuda.launches.clear()
    _grow_and_shrink(fast, range(1, 31))
    cache.wait_idle()
    assert len(cuda.executables) == cache.executables and cache.live_bytes <= cache.accounting.budget
    memory = [record.memory for record in fast.stats.graphs.values()]
    if not prefetch:
        assert cache.prefetcher.prefetches == 0 and not cuda.uploads
        assert all(name == threading.current_thread().name for name in cuda.threads)
        return
    assert cache.prefetcher.hits >= 100, f"{cache.prefetcher.hits} hits in 120 calls stepping by one"
    assert sum(m.prefetches for m in memory) == cache.prefetcher.prefetches
    (worker,) = cuda.threads - {threading.current_thread().name}
    assert worker.startswith("tendril-executables") and worker in cuda.relaxed_threads
    assert {stream for _, stream in cuda.uploads} == {0}  # uploaded on the stream of the predicting call
    fast._backend.executable_caches()[next(iter(fast._backend.executable_caches()))].close()
    assert not cuda.executables


def test_background_destructions_wait_for_the_last_launch(cuda: FakeCuda):
    cuda.family_per_shape = True  # nothing to update: every miss and prefetch instantiates, evicting
    fast = _graphed(_first, "2KiB", "update")
    fast.capture([(torch.randn(n),) for n in range(1, 9)], progress=False)
    cache = next(iter(fast._backend.executable_caches().values()))
    cache.accounting.budget = 2 * cache.accounting.charge(10)
    cuda.running = True  # every launch is still running when its executable is evicted
    for n in range(1, 9):
        x = torch.randn(n)
        torch.testing.assert_close(fast(x), _first(x))
    cache.wait_idle()
    driver = cache.driver
    assert driver.background_waits > 0 and driver.waits == 0  # waited on the worker, not on the calling thread
    assert cuda.synchronized == driver.background_waits


def test_a_background_update_waits_for_the_last_launch_then_uploads(cuda: FakeCuda):
    """`CudaExecutables.update_async` on the worker: waits for the executable's last launch, updates it and
    uploads it in the stream given; a refused update uploads nothing; a failed upload destroys the executable."""
    driver = executables_cuda.CudaExecutables(torch.device("cuda", 0))
    x = torch.randn(3)
    doubling, tripling, refusing = (FakeGraph(cuda, _scale, (t, f), {}) for t, f in ((x, 2.0), (x, 3.0), (x[:0], 4.0)))
    refusing.refuse_updates = True
    whole = (executables_cuda.ManagedGraph(g, (g.topology.nodes,)) for g in (doubling, tripling, refusing))
    doubling, tripling, refusing = whole
    chain, _ = driver.instantiate(doubling)
    (handle,) = chain.segments
    driver.launch(chain, cuda.streams[0])
    cuda.running = True  # the launch of `doubling` is still running when the update is submitted
    cuda.streams[5] = FakeStream(5)
    assert driver.update_async(chain, tripling, cuda.streams[5]).result().ok
    assert cuda.executables[handle] == tripling.graph.raw and cuda.uploads == [(handle, 5)]
    assert driver.background_waits == 1 == cuda.synchronized and driver.waits == 0
    (worker,) = cuda.update_threads
    assert worker.startswith("tendril-executables") and worker in cuda.relaxed_threads
    cuda.running = False
    refused = driver.update_async(chain, refusing, cuda.streams[5]).result()
    assert not refused.ok and cuda.executables[handle] == tripling.graph.raw and len(cuda.uploads) == 1
    cuda.fail_upload = True
    with pytest.raises(RuntimeError, match="cudaGraphUpload failed"):
        driver.update_async(chain, doubling, cuda.streams[5]).result()
    assert handle not in cuda.executables, "the executable of a failed background update must be destroyed"
    driver.close()


def test_update_prefetches_by_updating_on_the_worker_thread(cuda: FakeCuda):
    """Growing and shrinking lengths under `update` at a full budget: the prefetches update executables of the
    family on the worker (after their last launch, uploaded on the predicting call's stream); results equal the
    function's and no executable is made after the first calls."""
    fast = _graphed(_first, "2KiB", "update")  # one family (rank 1) of executables of 10 nodes
    lengths = range(8, 38)  # not 7: it refuses updates
    fast.capture([(torch.randn(n),) for n in lengths], progress=False)
    cache = next(iter(fast._backend.executable_caches().values()))
    cache.accounting.budget = 3 * cache.accounting.charge(10)  # room for the executable just called and two more
    cuda.running = True  # every launch is still running when the next prefetch is submitted
    made, updated = _memory_total(fast, "instantiations"), _memory_total(fast, "updates")
    _grow_and_shrink(fast, lengths)
    cache.wait_idle()
    assert _memory_total(fast, "instantiations") - made <= 2, "instantiated where it should have updated"
    assert _memory_total(fast, "updates") - updated >= 100 and _memory_total(fast, "update_failures") == 0
    assert cache.prefetcher.hits >= 100
    assert any(name.startswith("tendril-executables") for name in cuda.update_threads)
    assert {stream for _, stream in cuda.uploads} == {0} and len(cuda.uploads) >= 100
    assert cache.driver.background_waits >= 100
    assert len(cuda.executables) == cache.executables == 3 and cache.live_bytes <= cache.accounting.budget


def _memory_total(fast: Any, what: str) -> int:
    return sum(getattr(record.memory, what) for record in fast.stats.graphs.values())


def test_segment_sizes_of_a_gpt2_forward_graph():
    assert executables_cuda.segment_sizes(293) == (16, 32, 64, 96, 85)
    assert executables_cuda.segment_sizes(20) == (20,)  # a last piece of 4 joins the first 16
    assert executables_cuda.segment_sizes(0) == ()


@given(st.integers(min_value=1, max_value=5000))
def test_segment_sizes_cut_every_node_once_growing_from_a_small_first_segment(nodes: int):
    sizes = executables_cuda.segment_sizes(nodes)
    first, largest = executables_cuda.FIRST_SEGMENT_NODES, executables_cuda.MAX_SEGMENT_NODES
    assert sum(sizes) == nodes and min(sizes) >= 1
    if len(sizes) > 1:
        assert sizes[0] == first
        assert all(b == min(2 * a, largest) for a, b in itertools.pairwise(sizes[:-1]))
        assert sizes[-2] <= 2 * sizes[-1] and sizes[-1] <= largest + largest // 2


def test_segmented_graphs_switch_segment_by_segment_at_launch(cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch):
    """Graphs cut into segments: a switch updates each segment right before launching it (so the host updates
    the next segment while the GPU runs this one); a segment CUDA refuses is instantiated afresh and the call
    still runs its graph, the refusal counted."""
    monkeypatch.setattr(executables_cuda, "FIRST_SEGMENT_NODES", 5)  # the fake's graphs of 10 nodes: two segments each
    monkeypatch.setattr(executables_cuda, "MAX_SEGMENT_NODES", 5)
    fast = _graphed(_scale, "1KiB", "update", prefetch=False)  # room for no second executable: every miss updates
    x = torch.randn(4)
    for factor in (2.0, 3.0, 2.0):
        torch.testing.assert_close(fast(x, factor), _scale(x, factor))
    (chain,) = [e.handle for e in next(iter(fast._backend.executable_caches().values())).table.live]
    first, second = chain.segments
    assert cuda.log[-4:] == [("update", first), ("launch", first), ("update", second), ("launch", second)]
    memory = [record.memory for record in fast.stats.graphs.values()]
    assert all(m.segments == 2 for m in memory) and sum(m.updates for m in memory) == 2
    (tripling,) = [g for g in cuda.graphs.values() if isinstance(g, FakeGraph) and g.args[1] == 3.0]
    tripling.refuse_updates = True  # from now on CUDA refuses updates to it
    torch.testing.assert_close(fast(x, 3.0), _scale(x, 3.0))  # refused at launch, both segments re-instantiated
    driver = next(iter(fast._backend.executable_caches().values())).driver
    assert driver.refused_segments == 2 and _memory_total(fast, "update_failures") == 1
    assert [kind for kind, _ in cuda.log[-4:]] == ["update", "launch", "update", "launch"]
    torch.testing.assert_close(fast(x, 2.0), _scale(x, 2.0))  # the executable left with the split family
