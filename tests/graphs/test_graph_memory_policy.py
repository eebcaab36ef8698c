"""The graph-memory policy on the CPU: families, eviction order, budget accounting, update failures,
predicting the next call and prefetching its executable.

A fake driver stands in for CUDA: an "executable" is a handle that runs one fake graph; instantiating
takes `bytes_per_node` per node; an update is refused where the test says so. Background work either
completes at once or (`background="lazy"`, instantiations and updates) only when its future's result is
asked for, which is how a still-running prefetch looks to the cache. After every `acquire` the handle
returned must run exactly the requested graph (what makes results identical to dedicated executables),
must be alive, and the charges (pending prefetches included) must stay within the budget.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tendril.cuda.graph_exec import Topology, UpdateOutcome
from tendril.cuda.runtime import CudaError
from tendril.graphs.callable import graphed
from tendril.graphs.cuda_backend import CudaBackend
from tendril.graphs.executables import PRIOR_BYTES_PER_NODE, ExecutableCache, ExecutableState
from tendril.graphs.key import GraphKey, TensorSpec, next_in_step, step_between
from tendril.graphs.memory import parse_bytes
from tendril.graphs.options import GraphMemoryPolicy, MemoryStrategy
from tendril.graphs.stats import GraphMemory, GraphRecord, GraphStats
from tendril.graphs.zero_copy.lanes import LaneKey

KIB = 1 << 10


@dataclass(frozen=True)
class FakeGraph:
    name: str
    nodes: int
    family: str

    @property
    def topology(self) -> Topology:
        return Topology(self.nodes, self.family)


class LazyFuture(Future):
    """Background work that "runs" when its result is first asked for: until then the cache sees it pending."""

    def __init__(self, work: Callable[[], Any]) -> None:
        super().__init__()
        self._work = work

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self.set_result(self._work())
            except Exception as error:
                self.set_exception(error)
        return super().result(timeout)


class FakeDriver:
    def __init__(
        self, bytes_per_node: int = PRIOR_BYTES_PER_NODE, refuse: set[str] | None = None, background: str = "done"
    ) -> None:
        self.bytes_per_node = bytes_per_node
        self.refuse = refuse or set()
        """Names of graphs an update to is refused (as CUDA refuses e.g. a 2D memset change)."""
        self.background = background
        """"done": background work completes at once; "lazy": instantiations and updates when their result is
        asked for."""
        self.fail_background: str | None = None
        """"instantiate", "update" or "destroy": that background operation fails with a CUDA error."""
        self.running: dict[int, FakeGraph] = {}
        self.destroyed: set[int] = set()
        self.log: list[tuple[str, str]] = []
        self.upload_streams: list[Any] = []
        self.closed = False
        self._next = 1

    def instantiate(self, graph: FakeGraph) -> tuple[int, int | None]:
        handle, self._next = self._next, self._next + 1
        self.running[handle] = graph
        self.log.append(("instantiate", graph.name))
        return handle, graph.nodes * self.bytes_per_node

    def update(self, executable: int, graph: FakeGraph) -> UpdateOutcome:
        current = self.running[executable]
        assert current.nodes == graph.nodes and current.family.split("/")[0] == graph.family, "cross-family update"
        self.log.append(("update", graph.name))
        if graph.name in self.refuse:
            return UpdateOutcome(False, "cudaGraphExecUpdateErrorParametersChanged")
        self.running[executable] = graph
        return UpdateOutcome(True)

    def launch(self, executable: int, stream: Any, switch_to: FakeGraph | None = None) -> UpdateOutcome:
        """Switches first where asked; a refused switch runs the graph anyway (as the CUDA driver, which
        instantiates what CUDA refused)."""
        outcome = UpdateOutcome(True) if switch_to is None else self.update(executable, switch_to)
        if not outcome.ok:
            assert switch_to is not None
            self.running[executable] = switch_to
            self.log.append(("instantiate", switch_to.name))
        self.log.append(("launch", self.running[executable].name))
        return outcome

    def destroy(self, executable: int) -> None:
        assert executable in self.running, "destroyed twice"
        del self.running[executable]
        self.destroyed.add(executable)
        self.log.append(("destroy", str(executable)))

    def instantiate_async(self, graph: FakeGraph, stream: Any) -> Future[tuple[int, int | None]]:
        def work() -> tuple[int, int | None]:
            if self.fail_background == "instantiate":
                raise CudaError("cudaGraphInstantiateWithFlags failed: cudaErrorMemoryAllocation (2)")
            handle, _ = self.instantiate(graph)
            self.upload_streams.append(stream)
            return handle, None  # unmeasured, as the CUDA driver's background instantiations

        self.log.append(("prefetch", graph.name))
        return self._background(work)

    def _background(self, work: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = LazyFuture(work) if self.background == "lazy" else Future()
        if self.background != "lazy":
            _complete(future, work)
        return future

    def update_async(self, executable: int, graph: FakeGraph, stream: Any) -> Future[UpdateOutcome]:
        def work() -> UpdateOutcome:
            if self.fail_background == "update":
                self.destroy(executable)  # as the CUDA driver does when its background update raises
                raise CudaError("cudaGraphUpload failed: cudaErrorIllegalAddress (700)")
            outcome = self.update(executable, graph)
            if outcome.ok:
                self.upload_streams.append(stream)
            return outcome

        self.log.append(("prefetch-update", graph.name))
        return self._background(work)

    def destroy_async(self, executable: int) -> Future[None]:
        def work() -> None:
            if self.fail_background == "destroy":
                raise CudaError("cudaGraphExecDestroy failed: cudaErrorIllegalAddress (700)")
            self.destroy(executable)

        future: Future[None] = Future()
        _complete(future, work)
        return future

    def close(self) -> None:
        self.closed = True


def _complete(future: Future[Any], work: Callable[[], Any]) -> None:
    try:
        future.set_result(work())
    except Exception as error:
        future.set_exception(error)


def _cache(
    budget: int | None, graphs: list[FakeGraph], driver: FakeDriver | None = None
) -> tuple[ExecutableCache, FakeDriver, dict[str, GraphMemory]]:
    driver = driver or FakeDriver()
    cache = ExecutableCache(driver, budget)
    memories = {}
    for graph in graphs:
        memories[graph.name] = GraphMemory()
        cache.add(graph.name, graph, graph.topology, memories[graph.name])
    return cache, driver, memories


def _acquire(cache: ExecutableCache, driver: FakeDriver, graphs: dict[str, FakeGraph], name: str) -> int:
    handle = cache.acquire(name)
    assert handle in driver.running, "acquire returned a destroyed executable"
    assert driver.running[handle] == graphs[name], "the executable does not run the requested graph"
    if cache.accounting.budget is not None and cache.accounting.over_budget == 0:
        assert cache.live_bytes <= cache.accounting.budget
    assert all(
        e.state in (ExecutableState.READY, ExecutableState.INSTANTIATING, ExecutableState.UPDATING)
        for e in cache.table.live
    ), "an evicted executable is still in the cache"
    return handle


def _launch(cache: ExecutableCache, driver: FakeDriver, name: str) -> None:
    cache.launch(name, stream=None)
    assert driver.log[-1] == ("launch", name), "the launch did not run the requested graph"


def _graphs(*specs: tuple[str, int, str]) -> dict[str, FakeGraph]:
    return {name: FakeGraph(name, nodes, family) for name, nodes, family in specs}


def test_strategy_resolution():
    assert GraphMemoryPolicy().resolved is MemoryStrategy.DEDICATED
    assert GraphMemoryPolicy(budget=1 << 20).resolved is MemoryStrategy.UPDATE
    assert GraphMemoryPolicy(budget=5, strategy=MemoryStrategy.UPDATE).resolved is MemoryStrategy.UPDATE
    assert GraphMemoryPolicy(strategy="update").resolved is MemoryStrategy.UPDATE
    with pytest.raises(ValueError, match="'auto', 'dedicated', 'update'"):
        GraphMemoryPolicy(strategy="lru")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot hold a budget"):
        GraphMemoryPolicy(budget=1 << 20, strategy=MemoryStrategy.DEDICATED)


def test_parse_bytes():
    assert parse_bytes("256MiB") == 256 << 20
    assert parse_bytes("1.5 GiB") == 3 << 29
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("4096") == 4096
    assert parse_bytes(7) == 7
    assert parse_bytes(None) is None
    for bad in ("lots", "12 parsecs", "MiB", "-3MiB"):
        with pytest.raises(ValueError, match="memory size"):
            parse_bytes(bad)
    with pytest.raises(TypeError):
        parse_bytes(True)
    with pytest.raises(ValueError):
        parse_bytes(-1)


def test_a_full_budget_evicts_the_least_recently_used_executable():
    """Four graphs of four families (nothing to update): past the budget of two, a miss evicts the least recently
    used executable and instantiates."""
    graphs = _graphs(("a", 100, "f"), ("b", 100, "g"), ("c", 100, "h"), ("d", 100, "i"))
    budget = 2 * 100 * PRIOR_BYTES_PER_NODE  # two executables at the prior rate (the fake measures the same)
    cache, driver, memories = _cache(budget, list(graphs.values()))
    for name in ("a", "b", "c"):
        _acquire(cache, driver, graphs, name)
    assert cache.table.holder_keys() == ["b", "c"] and memories["a"].evictions == 1
    _acquire(cache, driver, graphs, "b")  # a hit refreshes b
    _acquire(cache, driver, graphs, "d")
    assert cache.table.holder_keys() == ["b", "d"] and memories["c"].evictions == 1
    assert [op for op, _ in driver.log].count("update") == 0 and memories["d"].strategy == "update"
    assert memories["b"].instantiations == 1 and memories["a"].executable_bytes == 0
    assert memories["d"].executable_bytes == 100 * PRIOR_BYTES_PER_NODE


def test_update_keeps_one_executable_per_family():
    graphs = _graphs(("L1", 50, "gpt"), ("L2", 50, "gpt"), ("L3", 50, "gpt"), ("W1", 80, "wav"), ("W2", 80, "wav"))
    cache, driver, memories = _cache(None, list(graphs.values()))
    for name in ("L1", "L2", "W1", "L3", "W2", "L1", "L1"):
        _acquire(cache, driver, graphs, name)
    assert cache.executables == 2
    assert [name for op, name in driver.log if op == "instantiate"] == ["L1", "W1"]
    assert memories["L1"].updates == 1 and memories["L2"].updates == 1 and memories["W2"].updates == 1
    assert memories["L1"].executable_bytes > 0 and memories["L3"].executable_bytes == 0
    assert memories["L1"].family == "gpt" and memories["L1"].strategy == "update"


def test_auto_under_a_full_budget_updates_within_the_family():
    """`auto` with a budget is `update`: while the budget has room it instantiates, once full a miss switches the
    least recently used executable of the graph's family (here a1's, for a3), and a graph of another family
    evicts and instantiates."""
    graphs = _graphs(("a1", 100, "A"), ("a2", 100, "A"), ("a3", 100, "A"), ("b1", 100, "B"))
    budget = 2 * 100 * PRIOR_BYTES_PER_NODE
    assert GraphMemoryPolicy(budget=budget).resolved is MemoryStrategy.UPDATE
    cache, driver, memories = _cache(budget, list(graphs.values()))
    for name in ("a1", "a2", "a3", "b1"):
        _acquire(cache, driver, graphs, name)
    assert [op for op, _ in driver.log].count("update") == 1
    assert memories["a3"].updates == 1 and memories["a3"].instantiations == 0
    assert cache.table.holder_keys() == ["a3", "b1"] and memories["b1"].instantiations == 1
    assert cache.accounting.over_budget == 0


def test_a_call_leaves_its_switch_to_the_launch():
    """`launch` hands a switch by update to the driver's launch (which pipelines it), counted as an update; a hit
    or an instantiation launches as it is."""
    graphs = _graphs(("a1", 100, "A"), ("a2", 100, "A"))
    cache, driver, memories = _cache(100 * PRIOR_BYTES_PER_NODE, list(graphs.values()))
    _launch(cache, driver, "a1")
    _launch(cache, driver, "a2")
    _launch(cache, driver, "a2")
    assert [op for op, _ in driver.log] == ["instantiate", "launch", "update", "launch", "launch"]
    assert memories["a2"].updates == 1 and cache.table.holder_keys() == ["a2"]


def test_a_switch_refused_at_launch_splits_the_family_with_its_executable():
    """CUDA refuses an update only the launch tries: the launch still runs the graph (the driver instantiated it),
    the graph moves into a family of its own and takes the executable along, so the old family's next graph is
    instantiated rather than updated into a refusing executable."""
    graphs = _graphs(("a1", 100, "A"), ("a2", 100, "A"), ("a3", 100, "A"))
    driver = FakeDriver(refuse={"a2"})
    cache, driver, memories = _cache(100 * PRIOR_BYTES_PER_NODE, list(graphs.values()), driver)
    _launch(cache, driver, "a1")
    _launch(cache, driver, "a2")
    assert memories["a2"].update_failures == 1 and memories["a2"].updates == 0
    assert memories["a2"].family != "A" and cache.table.family("a2") == memories["a2"].family
    driver.log.clear()
    _launch(cache, driver, "a3")
    assert [op for op, _ in driver.log] == ["destroy", "instantiate", "launch"] and memories["a2"].evictions == 1


def test_a_measurement_that_raises_the_charges_evicts_to_keep_the_budget():
    """An instantiation measured at twice the prior rate raises every executable's charge: the cache evicts the
    least recently used (never the new one) until the charges fit again, so the budget holds."""
    graphs = _graphs(("a", 100, "A"), ("b", 100, "B"), ("c", 100, "C"))
    budget = 3 * 100 * PRIOR_BYTES_PER_NODE
    driver = FakeDriver()
    cache, driver, memories = _cache(budget, list(graphs.values()), driver)
    _acquire(cache, driver, graphs, "a")
    _acquire(cache, driver, graphs, "b")
    driver.bytes_per_node = 40 * PRIOR_BYTES_PER_NODE
    _acquire(cache, driver, graphs, "c")
    assert cache.accounting.over_budget == 0 and cache.live_bytes <= budget
    assert cache.table.holder_keys()[-1] == "c" and memories["a"].evictions == 1


def test_a_refused_update_reinstantiates_in_a_family_of_its_own():
    graphs = _graphs(("x", 60, "F"), ("y", 60, "F"), ("z", 60, "F"))
    cache, driver, memories = _cache(None, list(graphs.values()), FakeDriver(refuse={"y"}))
    _acquire(cache, driver, graphs, "x")
    _acquire(cache, driver, graphs, "y")  # refused: x's executable is destroyed, y instantiated apart
    assert memories["y"].update_failures == 1 and memories["y"].instantiations == 1
    assert memories["x"].evictions == 1 and cache.table.family("y") != cache.table.family("x")
    _acquire(cache, driver, graphs, "z")  # z's family has no executable now: instantiated
    _acquire(cache, driver, graphs, "x")  # x switches z's executable
    _acquire(cache, driver, graphs, "y")  # y has its own executable still
    assert memories["x"].updates == 1 and memories["y"].update_failures == 1
    assert [op for op, name in driver.log if name == "y"] == ["update", "instantiate"]


def test_budget_accounting_learns_the_driver_rate_and_counts_reservations():
    graphs = _graphs(("p", 1000, "P"), ("q", 1000, "Q"))
    heavy = FakeDriver(bytes_per_node=4 * PRIOR_BYTES_PER_NODE)
    cache, driver, _ = _cache(64 * 1000 * KIB, list(graphs.values()), heavy)
    before = cache.accounting.bytes_per_node
    _acquire(cache, driver, graphs, "p")
    assert cache.accounting.bytes_per_node > before  # measured more than the prior
    assert cache.accounting.charge(1000) == pytest.approx(1000 * cache.accounting.bytes_per_node, abs=1)
    cache.reserve(cache.accounting.budget)  # e.g. executables that must stay dedicated fill the budget
    assert cache.executables == 0 and cache.live_bytes == cache.accounting.budget
    _acquire(cache, driver, graphs, "q")  # a graph must still run: over budget, counted
    assert cache.accounting.over_budget == 1 and cache.executables == 1


def test_discard_and_close_destroy_executables():
    graphs = _graphs(("a", 10, "A"), ("b", 10, "B"))
    cache, driver, memories = _cache(None, list(graphs.values()))
    _acquire(cache, driver, graphs, "a")
    _acquire(cache, driver, graphs, "b")
    cache.discard("a")
    assert cache.executables == 1 and len(driver.running) == 1
    cache.close()
    assert not driver.running and memories["b"].executable_bytes == 0 and driver.closed


@settings(max_examples=60, deadline=None)
@given(
    budget_graphs=st.integers(min_value=1, max_value=5),
    calls=st.lists(st.integers(min_value=0, max_value=11), min_size=1, max_size=80),
    refused=st.sets(st.integers(min_value=0, max_value=11), max_size=3),
)
def test_random_call_orders_always_run_the_requested_graph_within_budget(budget_graphs, calls, refused):
    specs = [(f"g{i}", 40 + 10 * (i % 3), f"F{i % 3}") for i in range(12)]  # three families of four
    graphs = _graphs(*specs)
    driver = FakeDriver(refuse={f"g{i}" for i in refused})
    budget = budget_graphs * 60 * PRIOR_BYTES_PER_NODE
    cache, driver, memories = _cache(budget, list(graphs.values()), driver)
    for index in calls:
        _acquire(cache, driver, graphs, f"g{index}")
        assert cache.accounting.over_budget == 0
        assert len(driver.running) == cache.executables
    assert sum(m.instantiations for m in memories.values()) >= 1
    assert sum(m.executable_bytes for m in memories.values()) == cache.live_bytes


def test_memory_policies_validate_without_cuda():
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with pytest.raises(ValueError, match="memory size"):
        GraphMemoryPolicy(budget="a lot")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="graph memory strategy"):
        GraphMemoryPolicy(strategy="smart")  # type: ignore[arg-type]
    backend = CudaBackend(memory=GraphMemoryPolicy(budget="16MiB", strategy="update"))  # type: ignore[arg-type]
    assert backend.memory.budget == 16 << 20 and backend.managed
    fast = graphed(double, backend=backend)
    x = torch.arange(4.0)
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning):
            torch.testing.assert_close(fast(x), x * 2)


def test_stats_report_switching_per_graph():
    from tendril.graphs.key import GraphKey

    stats = GraphStats()
    memory = GraphMemory(strategy="auto", family="abc", nodes=10, executable_bytes=1 << 20, updates=3, switch_ms=0.5)
    key = GraphKey((), (), ())
    stats.graphs[key] = GraphRecord(key, 1.0, 0, None, memory=memory)
    assert stats.executable_bytes == 1 << 20 and stats.switch_ms == 0.5
    assert "auto: family abc" in stats.table() and "3 updates" in stats.table()
    assert "executables now 1.0 MiB, switching 0.5 ms" in stats.table().splitlines()[0]


# -- predicting the next call and prefetching its executable -------------------------------------------------

CUDA0 = torch.device("cuda", 0)


def _key(*shapes: tuple[int, ...], dtype: torch.dtype = torch.int64, constants: tuple = ()) -> GraphKey:
    return GraphKey(("flat", len(shapes), ()), tuple(TensorSpec(s, dtype, CUDA0) for s in shapes), constants)


def _ids(n: int) -> GraphKey:
    """The key of a GPT-2-like call on token ids of length `n`."""
    return _key((1, n))


def test_next_in_step_continues_constant_steps():
    assert next_in_step(_ids(3), _ids(4), _ids(5)) == _ids(6)
    assert next_in_step(_ids(10), _ids(8), _ids(6)) == _ids(4)  # shrinking by two
    assert next_in_step(_key((1, 2), (2, 8)), _key((1, 3), (3, 8)), _key((1, 4), (4, 8))) == _key((1, 5), (5, 8))
    assert step_between(_ids(3), _key((2, 3))) == ((1, 0),)
    assert next_in_step(_ids(1), _ids(2), _ids(4)) is None  # steps differ
    assert next_in_step(_ids(4), _ids(4), _ids(4)) is None  # no step: nothing to predict
    assert next_in_step(_ids(6), _ids(3), _ids(0)) is None  # would step below zero
    assert next_in_step(_ids(1), _key((1, 2), dtype=torch.int32), _key((1, 3), dtype=torch.int32)) is None
    assert next_in_step(_ids(1), _ids(2), _key((1, 2, 1))) is None  # rank changed
    bound = [_key((1, n), constants=((1, int, 7),)) for n in (1, 2, 3)]
    assert next_in_step(*bound) == _key((1, 4), constants=((1, int, 7),))
    assert next_in_step(_ids(1), _ids(2), _key((1, 3), constants=((1, int, 7),))) is None  # constants differ
    assert next_in_step("a", "b", "c") is None  # not graph keys


def test_next_in_step_keeps_lane_keys_apart_from_plain_keys():
    def lane(n: int, lane: int = 1, generation: int = 0) -> LaneKey:
        return LaneKey(("flat", 1, ()), (TensorSpec((1, n), torch.int64, CUDA0),), (), lane, generation)

    predicted = next_in_step(lane(1), lane(2), lane(3))
    assert predicted == lane(4) and isinstance(predicted, LaneKey)
    assert next_in_step(_ids(1), lane(2), lane(3)) is None
    assert next_in_step(lane(1), lane(2), _ids(3)) is None
    assert next_in_step(lane(1), lane(2), lane(3, lane=2)) is None
    assert next_in_step(lane(1), lane(2, generation=1), lane(3, generation=1)) is None


def _keyed_cache(
    lengths: range,
    budget_executables: int | None,
    driver: FakeDriver | None = None,
    nodes: int = 100,
    families: int | Callable[[int], str] = 1,
    ahead: int = 1,
) -> tuple[ExecutableCache, FakeDriver, dict[GraphKey, FakeGraph], dict[GraphKey, GraphMemory]]:
    """Graphs of lengths `lengths` keyed as GPT-2 calls, in `families` topology families (length modulo, or the
    family each length is in); prefetching `ahead` calls ahead."""
    driver = driver or FakeDriver()
    budget = None if budget_executables is None else budget_executables * nodes * PRIOR_BYTES_PER_NODE
    cache = ExecutableCache(driver, budget, predict_next=next_in_step, ahead=ahead)
    graphs, memories = {}, {}
    for n in lengths:
        family = families(n) if callable(families) else "gpt" if families == 1 else f"gpt{n % families}"
        graphs[_ids(n)] = FakeGraph(f"L{n}", nodes, family)
        memories[_ids(n)] = GraphMemory()
        cache.add(_ids(n), graphs[_ids(n)], graphs[_ids(n)].topology, memories[_ids(n)])
    return cache, driver, graphs, memories


def _own_family(n: int) -> str:
    """Every length a family of its own: nothing can be updated, so every miss instantiates (evicting the least
    recently used past the budget) and every prefetch is a background instantiation."""
    return f"L{n}"


def _call(cache: ExecutableCache, driver: FakeDriver, graphs: dict[GraphKey, FakeGraph], key: GraphKey) -> int:
    """What a replay does: acquire, (launch), then let the cache prefetch; checks the invariants."""
    handle = _acquire(cache, driver, graphs, key)
    nearer = {k: cache.table.holding[k] for k in cache.prefetcher.forecast.predicted() if k in cache.table.holding}
    cache.prefetch_next(stream="the call's stream")
    assert all(cache.table.holding.get(k) is e for k, e in nearer.items()), (
        "took an executable held for a predicted call"
    )
    assert handle in driver.running, "prefetching destroyed the executable just called"
    assert driver.running[handle] == graphs[key], "prefetching updated the executable just called"
    if cache.accounting.budget is not None and cache.accounting.over_budget == 0:
        assert cache.live_bytes <= cache.accounting.budget, "a pending prefetch took the charges past the budget"
    return handle


def _total(memories: dict[Any, GraphMemory], field: str) -> int:
    return sum(getattr(m, field) for m in memories.values())


def test_growing_lengths_prefetch_the_next_executable():
    cache, driver, graphs, memories = _keyed_cache(range(1, 21), budget_executables=3, families=_own_family)
    for n in range(1, 21):
        _call(cache, driver, graphs, _ids(n))
    # calls 1-3 instantiate (no two equal steps yet); each later call finds the executable prefetched
    assert _total(memories, "prefetches") == 17 == cache.prefetcher.prefetches == cache.prefetcher.hits
    assert cache.prefetcher.waits == 0 and cache.prefetcher.wasted == 0
    assert [name for op, name in driver.log if op == "prefetch"] == [f"L{n}" for n in range(4, 21)]
    assert memories[_ids(1)].prefetches == 0 and memories[_ids(7)].prefetch_hits == 1
    assert set(driver.upload_streams) == {"the call's stream"}
    assert cache.table.pending_keys() == []  # L21 is not registered: nothing prefetched after the last call
    for n in range(19, 0, -1):  # and back down: steps of -1 are predicted as well
        _call(cache, driver, graphs, _ids(n))
    assert cache.prefetcher.hits > 17 + 10


def test_shrinking_by_two_prefetches_every_other_length():
    cache, driver, graphs, memories = _keyed_cache(range(1, 31), budget_executables=2, families=_own_family)
    for n in range(30, 0, -2):
        _call(cache, driver, graphs, _ids(n))
    assert cache.prefetcher.hits == 12 and cache.prefetcher.wasted == 0 and cache.accounting.over_budget == 0
    assert all(memories[_ids(n)].prefetches == 0 for n in range(1, 31, 2))


def _two_families(n: int) -> str:
    return "A" if n < 10 else "B"


def _first_prefetch(driver: FakeDriver, calls: list[int], cache: ExecutableCache, graphs: Any) -> dict[str, int]:
    """Make `calls`; the call after which each graph was first prefetched (instantiated or updated)."""
    prefetched_at: dict[str, int] = {}
    for n in calls:
        _call(cache, driver, graphs, _ids(n))
        for op, name in driver.log:
            if op.startswith("prefetch"):
                prefetched_at.setdefault(name, n)
    return prefetched_at


def test_update_instantiates_a_family_entry_calls_before_it_runs():
    """Under `update` three calls ahead, a growing pass into family B (from L10), which holds no executable: L10 is
    instantiated after call 7 and L11 (B's second executable: the run alternates two) after call 8; one call ahead,
    after calls 9 and 10. Every call after the third finds its executable made."""
    for ahead, (ten, eleven) in ((3, (7, 8)), (1, (9, 10))):
        cache, driver, graphs, _ = _keyed_cache(range(1, 21), 4, families=_two_families, ahead=ahead)
        prefetched_at = _first_prefetch(driver, list(range(1, 21)), cache, graphs)
        assert (prefetched_at["L10"], prefetched_at["L11"]) == (ten, eleven)
        assert ("prefetch", "L10") in driver.log and ("prefetch", "L11") in driver.log  # instantiated, not updated
        assert cache.prefetcher.hits == 17 == cache.prefetcher.prefetches and cache.prefetcher.waits == 0
        assert cache.accounting.over_budget == 0 and cache.prefetcher.wasted == 0


def test_an_early_instantiation_leaves_the_familys_executables_alone():
    """B holds one executable (of L15, called first) when the pass reaches it: L11, B's second, is instantiated
    early (after call 8) without evicting it, and L10 then takes it by an update (after call 9)."""
    cache, driver, graphs, _ = _keyed_cache(range(1, 21), 4, families=_two_families, ahead=3)
    prefetched_at = _first_prefetch(driver, [15, *range(1, 21)], cache, graphs)
    assert (prefetched_at["L10"], prefetched_at["L11"]) == (9, 8)
    assert ("prefetch-update", "L10") in driver.log and ("prefetch", "L11") in driver.log
    assert cache.prefetcher.hits == 17 and cache.prefetcher.waits == 0 and cache.accounting.over_budget == 0


def test_no_early_instantiation_where_the_budget_holds_no_more():
    """A budget of two holds the executable just called and the next call's: B's entry is made one call ahead."""
    cache, driver, graphs, _ = _keyed_cache(range(1, 21), 2, families=_two_families, ahead=3)
    prefetched_at = _first_prefetch(driver, list(range(1, 21)), cache, graphs)
    assert prefetched_at["L10"] == 9 and cache.accounting.over_budget == 0 and cache.executables <= 2


def test_a_growing_run_in_one_family_alternates_two_executables():
    """Without a budget, three calls ahead, one family: two executables (one runs while the other is updated)."""
    cache, driver, graphs, memories = _keyed_cache(range(1, 41), None, ahead=3)
    for n in range(1, 41):
        _call(cache, driver, graphs, _ids(n))
        assert cache.executables <= 2
    assert _total(memories, "instantiations") == 2 and cache.prefetcher.hits == 37


def test_lookahead_must_be_positive():
    with pytest.raises(ValueError, match="at least one call ahead"):
        ExecutableCache(FakeDriver(), None, predict_next=next_in_step, ahead=0)


def test_capture_time_acquisitions_do_not_count_as_calls():
    cache, *_ = _keyed_cache(range(1, 6), budget_executables=None, families=_own_family)
    for n in (1, 2, 3):
        cache.acquire(_ids(n), call=False)
    assert cache.prefetch_next() == [] and cache.prefetcher.prefetches == 0


def test_no_prefetch_when_the_budget_holds_only_the_executable_just_called():
    cache, driver, graphs, memories = _keyed_cache(range(1, 11), budget_executables=1, families=_own_family)
    for n in range(1, 11):
        _call(cache, driver, graphs, _ids(n))
    assert (
        cache.prefetcher.prefetches == 0
        and _total(memories, "instantiations") == 10
        and cache.accounting.over_budget == 0
    )


def test_without_a_predictor_nothing_is_prefetched():
    graphs = {_ids(n): FakeGraph(f"L{n}", 100, "gpt") for n in range(1, 8)}
    for budget in (None, 2 * 100 * PRIOR_BYTES_PER_NODE):
        driver = FakeDriver()
        cache = ExecutableCache(driver, budget, predict_next=None)
        for key, graph in graphs.items():
            cache.add(key, graph, graph.topology, GraphMemory())
        for key in graphs:
            _acquire(cache, driver, graphs, key)
            assert cache.prefetch_next() == []
        assert not cache.prefetcher.enabled and not {"prefetch", "prefetch-update"} & {op for op, _ in driver.log}


def test_a_call_waits_for_a_pending_prefetch():
    cache, driver, graphs, _ = _keyed_cache(range(1, 9), 3, FakeDriver(background="lazy"), families=_own_family)
    for n in range(1, 9):
        _call(cache, driver, graphs, _ids(n))
        assert cache.executables == len(driver.running) + len(cache.table.pending_keys())
    assert cache.prefetcher.hits == 5 == cache.prefetcher.waits  # lazy: every prefetch is still pending at its call
    assert cache.table.pending_keys() == []


def test_waiting_on_a_background_thread_counts_as_switching_time():
    """The wait for a prefetch still running counts in the graph's switch_ms; the background time does not."""

    go = threading.Event()  # the prefetch completes 50 ms after the test starts waiting for it, never before

    class SlowDriver(FakeDriver):
        def instantiate_async(self, graph: FakeGraph, stream: Any) -> Future[tuple[int, int | None]]:
            future: Future[tuple[int, int | None]] = Future()
            handle, _ = self.instantiate(graph)

            def finish() -> None:
                go.wait()
                time.sleep(0.05)
                future.set_result((handle, None))

            threading.Thread(target=finish, daemon=True).start()
            return future

    cache, driver, graphs, memories = _keyed_cache(range(1, 6), None, SlowDriver(), families=_own_family)
    for n in (1, 2, 3):
        _call(cache, driver, graphs, _ids(n))
    assert cache.table.pending_keys() == [_ids(4)]
    before = memories[_ids(4)].switch_ms
    started = time.perf_counter()
    go.set()
    _acquire(cache, driver, graphs, _ids(4))
    waited_ms = (time.perf_counter() - started) * 1e3
    assert cache.prefetcher.waits == 1 and waited_ms >= 45
    assert memories[_ids(4)].switch_ms - before == pytest.approx(waited_ms, abs=5)


def test_a_prefetch_evicted_before_its_call_is_wasted():
    cache, driver, graphs, memories = _keyed_cache(range(1, 21), 2, FakeDriver(background="lazy"), families=_own_family)
    for n in (1, 2, 3):
        _call(cache, driver, graphs, _ids(n))
    assert cache.table.pending_keys() == [_ids(4)]
    _call(cache, driver, graphs, _ids(10))  # mispredicted: 3, used before 4 was prefetched, makes room
    assert cache.table.pending_keys() == [_ids(4)]
    _call(cache, driver, graphs, _ids(11))  # now 4 is the least recently used: evicted unused
    assert memories[_ids(4)].prefetch_wasted == 1 == cache.prefetcher.wasted and cache.prefetcher.hits == 0
    assert ("instantiate", "L4") in driver.log  # waited for, to destroy what it made
    assert memories[_ids(4)].evictions == 1 and cache.table.pending_keys() == []


def test_random_orders_rarely_prefetch():
    import random

    cache, driver, graphs, _ = _keyed_cache(range(1, 33), budget_executables=4, families=_own_family)
    rng = random.Random(11)
    for _ in range(300):
        _call(cache, driver, graphs, _ids(rng.randint(1, 32)))
    assert cache.prefetcher.prefetches <= 12, f"{cache.prefetcher.prefetches} prefetches in 300 random calls"


def test_a_failed_background_instantiation_surfaces_at_the_call():
    cache, driver, graphs, _ = _keyed_cache(range(1, 9), 3, FakeDriver(background="lazy"), families=_own_family)
    driver.fail_background = "instantiate"
    for n in (1, 2, 3):
        _call(cache, driver, graphs, _ids(n))
    with pytest.raises(CudaError, match="cudaErrorMemoryAllocation") as raised:
        cache.acquire(_ids(4))
    assert "background thread" in "".join(getattr(raised.value, "__notes__", []))
    assert cache.table.pending_keys() == [] and _ids(4) not in cache.table.holder_keys()
    driver.fail_background = None
    _acquire(cache, driver, graphs, _ids(4))  # the next call instantiates it on the calling thread
    assert cache.executables == len(driver.running)


def test_a_failed_background_destruction_surfaces_at_the_next_call():
    cache, driver, graphs, _ = _keyed_cache(range(1, 9), 2, families=_own_family)
    for n in (1, 2, 3):
        _call(cache, driver, graphs, _ids(n))
    driver.fail_background = "destroy"
    _call(cache, driver, graphs, _ids(4))  # the prefetch of 5 evicts 3 in the background: that fails
    with pytest.raises(CudaError, match="cudaGraphExecDestroy failed"):
        cache.acquire(_ids(5))


def test_close_waits_for_pending_prefetches_and_stops_the_driver():
    cache, driver, graphs, memories = _keyed_cache(range(1, 9), 3, FakeDriver(background="lazy"), families=_own_family)
    for n in (1, 2, 3):
        _call(cache, driver, graphs, _ids(n))
    cache.close()
    assert not driver.running and driver.closed and cache.executables == 0
    assert _total(memories, "executable_bytes") == 0


def _runs(segments: list[tuple[int, int, int]], top: int) -> list[int]:
    """Lengths of runs that start at `start` and step by `step` for `count` calls, clipped to 1..top."""
    lengths = []
    for start, step, count in segments:
        lengths += [min(max(start + i * step, 1), top) for i in range(count)]
    return lengths


@settings(max_examples=60, deadline=None)
@given(
    budget_executables=st.integers(min_value=1, max_value=5),
    segments=st.lists(
        st.tuples(st.integers(1, 16), st.sampled_from([-2, -1, 1, 2, 3]), st.integers(1, 8)), min_size=1, max_size=12
    ),
    lazy=st.booleans(),
)
def test_prefetching_runs_the_requested_graph_within_budget(budget_executables, segments, lazy):
    """Runs of stepping lengths mixed with jumps: every call gets its own graph, the charges (pending prefetches
    included) never pass the budget, and every prefetch is either hit, wasted, or still held."""
    driver = FakeDriver(background="lazy" if lazy else "done")
    cache, driver, graphs, memories = _keyed_cache(range(1, 17), budget_executables, driver, families=_own_family)
    for n in _runs(segments, 16):
        _call(cache, driver, graphs, _ids(n))
        assert cache.accounting.over_budget == 0
        assert cache.executables == len(driver.running) + (len(cache.table.pending_keys()) if lazy else 0)
    assert cache.prefetcher.prefetches == cache.prefetcher.hits + cache.prefetcher.wasted + len(
        cache.table.pending_keys()
    )
    assert _total(memories, "executable_bytes") == cache.live_bytes


# -- `update`: switching an executable of the family once the budget is full, on the call path and ahead ------


def test_update_instantiates_while_the_budget_has_room():
    graphs = _graphs(("a1", 100, "A"), ("a2", 100, "A"), ("a3", 100, "A"))
    cache, driver, memories = _cache(3 * 100 * PRIOR_BYTES_PER_NODE, list(graphs.values()))
    for name in ("a1", "a2", "a3"):
        _acquire(cache, driver, graphs, name)
    assert [op for op, _ in driver.log] == ["instantiate"] * 3
    assert cache.table.holder_keys() == ["a1", "a2", "a3"] and _total(memories, "updates") == 0


def test_update_at_a_full_budget_switches_the_familys_least_recently_used_executable():
    """At a full budget, a3 does not evict the least recently used executable (b1's): it switches the least recently
    used executable of its family (a2's) and evicts nothing."""
    graphs = _graphs(("a1", 100, "A"), ("a2", 100, "A"), ("a3", 100, "A"), ("b1", 100, "B"))
    cache, driver, memories = _cache(3 * 100 * PRIOR_BYTES_PER_NODE, list(graphs.values()))
    handles = {name: _acquire(cache, driver, graphs, name) for name in ("a1", "b1", "a2", "a1")}
    assert cache.table.holder_keys() == ["b1", "a2", "a1"]
    assert _acquire(cache, driver, graphs, "a3") == handles["a2"]
    assert cache.table.holder_keys() == ["b1", "a1", "a3"]
    assert driver.log[-1] == ("update", "a3") and [op for op, _ in driver.log].count("instantiate") == 3
    assert memories["a3"].updates == 1 and memories["a3"].instantiations == 0 and _total(memories, "evictions") == 0
    assert memories["a2"].executable_bytes == 0 and memories["a3"].executable_bytes == 100 * PRIOR_BYTES_PER_NODE


def test_update_at_a_full_budget_without_an_executable_of_the_family_evicts_and_instantiates():
    graphs = _graphs(("a1", 100, "A"), ("b1", 100, "B"), ("c1", 100, "C"))
    cache, driver, memories = _cache(2 * 100 * PRIOR_BYTES_PER_NODE, list(graphs.values()))
    for name in ("a1", "b1", "c1"):
        _acquire(cache, driver, graphs, name)
    assert cache.table.holder_keys() == ["b1", "c1"] and memories["a1"].evictions == 1
    assert [op for op, _ in driver.log] == ["instantiate", "instantiate", "destroy", "instantiate"]


def test_update_evicts_an_executable_its_family_can_spare_before_a_familys_last():
    """b1 is the least recently used, but the last of its family; a1 and a2 are both family A's: a miss in family C
    evicts a1 (A keeps a2 to update), not b1; a later miss in family B then updates b1's executable."""
    graphs = _graphs(("b1", 100, "B"), ("a1", 100, "A"), ("a2", 100, "A"), ("c1", 100, "C"), ("b2", 100, "B"))
    cache, driver, memories = _cache(3 * 100 * PRIOR_BYTES_PER_NODE, list(graphs.values()))
    for name in ("b1", "a1", "a2", "c1"):
        _acquire(cache, driver, graphs, name)
    assert memories["a1"].evictions == 1 and _total(memories, "evictions") == 1
    assert cache.table.holder_keys() == ["b1", "a2", "c1"]
    made = _total(memories, "instantiations")
    _acquire(cache, driver, graphs, "b2")
    assert memories["b2"].updates == 1 and _total(memories, "instantiations") == made


def test_a_family_keeps_its_last_executable_while_others_have_spares():
    """The `graphs-memory` sequence with its counts (1024 lengths in 49 families, 20 of them below 160 tokens, 55
    executables): capture from the largest, four growing passes, then random passes. Every family keeps an
    executable through the growing passes, so the random calls only update (no instantiation)."""
    bounds = [round(160 * i / 20) for i in range(1, 21)] + [160 + round(864 * i / 29) for i in range(1, 30)]
    cache, driver, graphs, memories = _keyed_cache(
        range(1, 1025),
        55,
        ahead=3,
        families=lambda n: f"f{next(i for i, bound in enumerate(bounds) if n <= bound)}",
    )
    for n in range(1024, 0, -1):
        _call(cache, driver, graphs, _ids(n))
    for _ in range(4):
        for n in range(1, 1025):
            _call(cache, driver, graphs, _ids(n))
    assert len({cache.table.family(key) for key in cache.table.holder_keys()}) == 49
    order = list(range(1, 1025))
    random.Random(0).shuffle(order)
    made = _total(memories, "instantiations")
    for n in order * 2:
        _call(cache, driver, graphs, _ids(n))
    assert _total(memories, "instantiations") == made
    assert cache.accounting.over_budget == 0 and _total(memories, "executable_bytes") == cache.live_bytes


def test_update_prefetches_at_a_full_budget_by_updating_an_executable_of_the_family():
    """Growing lengths under a budget of three: the first three calls instantiate (room); from then on every
    prefetch switches the family's least recently used executable in the background (uploaded in the call's
    stream), and every call takes it: three instantiations in twenty calls, no eviction."""
    cache, driver, graphs, memories = _keyed_cache(range(1, 21), 3)
    handles = [_call(cache, driver, graphs, _ids(n)) for n in range(1, 21)]
    assert [name for op, name in driver.log if op == "prefetch-update"] == [f"L{n}" for n in range(4, 21)]
    assert _total(memories, "instantiations") == 3 and "prefetch" not in {op for op, _ in driver.log}
    assert _total(memories, "updates") == 17 == cache.prefetcher.prefetches == cache.prefetcher.hits
    assert memories[_ids(9)].updates == 1 == memories[_ids(9)].prefetches and memories[_ids(9)].prefetch_hits == 1
    assert cache.prefetcher.waits == 0 and cache.prefetcher.wasted == 0 and _total(memories, "evictions") == 0
    assert handles[3] == handles[0] and handles[4] == handles[1], "not the least recently used executable"
    assert driver.upload_streams == ["the call's stream"] * 17
    assert cache.executables == 3 and cache.accounting.over_budget == 0


def test_a_pending_background_update_is_waited_for():
    cache, driver, graphs, _ = _keyed_cache(range(1, 9), 3, FakeDriver(background="lazy"))
    for n in range(1, 9):
        _call(cache, driver, graphs, _ids(n))  # checks the call ran its graph: the update had completed
    assert cache.prefetcher.hits == 5 == cache.prefetcher.waits
    assert [op for op, _ in driver.log].count("update") == 5


def test_update_never_switches_the_executable_just_called():
    """After call 3, the only executable of the family is the one just called (L3's; the other one is another
    family's): the prefetch of L4 evicts the other one and instantiates, leaving L3's executable alone."""
    cache, driver, graphs, memories = _keyed_cache(range(1, 6), 2)
    other = _key((2, 2))
    graphs[other] = FakeGraph("other", 100, "another family")
    memories[other] = GraphMemory()
    cache.add(other, graphs[other], graphs[other].topology, memories[other])
    _call(cache, driver, graphs, other)
    for n in (1, 2, 3):  # L1 instantiated (room), L2 and L3 switch it (the budget is full)
        _call(cache, driver, graphs, _ids(n))
    assert _total(memories, "updates") == 2 and memories[other].evictions == 1
    assert cache.table.pending_keys() == [_ids(4)] and ("prefetch", "L4") in driver.log
    assert "prefetch-update" not in {op for op, _ in driver.log}


def test_a_refused_background_update_reinstantiates_in_a_family_of_its_own():
    driver = FakeDriver(refuse={"L4"}, background="lazy")
    cache, driver, graphs, memories = _keyed_cache(range(1, 9), 3, driver)
    for n in (1, 2, 3):
        _call(cache, driver, graphs, _ids(n))
    assert cache.table.pending_keys() == [_ids(4)]
    _call(cache, driver, graphs, _ids(4))  # takes the update: refused, so L1's executable is destroyed, L4 made
    four = memories[_ids(4)]
    assert four.update_failures == 1 and four.updates == 0 and four.instantiations == 1 and four.evictions == 1
    assert four.prefetch_hits == 1 and cache.table.family(_ids(4)) != cache.table.family(_ids(1))
    assert [op for op, name in driver.log if name == "L4"] == ["prefetch-update", "update", "instantiate"]
    assert cache.executables == len(driver.running) + len(cache.table.pending_keys()) - 1  # the pending one exists
    _call(cache, driver, graphs, _ids(5))  # 5 stays in the family: its prefetched update was accepted
    assert memories[_ids(5)].updates == 1 and cache.accounting.over_budget == 0


def test_a_failed_background_update_surfaces_at_the_call():
    cache, driver, graphs, _ = _keyed_cache(range(1, 9), 3, FakeDriver(background="lazy"))
    for n in (1, 2, 3):
        _call(cache, driver, graphs, _ids(n))
    driver.fail_background = "update"
    with pytest.raises(CudaError, match="cudaGraphUpload failed") as raised:
        cache.acquire(_ids(4))
    assert "background thread updating" in "".join(getattr(raised.value, "__notes__", []))
    assert cache.executables == len(driver.running) == 2 and _ids(4) not in cache.table.holder_keys()
    driver.fail_background = None
    _acquire(cache, driver, graphs, _ids(4))  # the next call instantiates it on the calling thread (room again)
    assert cache.executables == len(driver.running) == 3


def test_update_without_a_budget_keeps_two_executables_per_family():
    """One executable for the calls, one for the prefetch: after the first call only updates (foreground for
    calls 2 and 3, then background), and one more instantiation for the first prefetch."""
    cache, driver, graphs, memories = _keyed_cache(range(1, 21), None)
    for n in range(1, 21):
        _call(cache, driver, graphs, _ids(n))
    assert [name for op, name in driver.log if op == "instantiate"] == ["L1", "L4"]
    assert cache.executables == 2 and _total(memories, "updates") == 18
    assert cache.prefetcher.prefetches == 17 == cache.prefetcher.hits


def _made(cache: ExecutableCache) -> int:
    """Executables the lazy driver has made: all but the pending instantiations (a pending update's exists)."""
    return sum(1 for e in cache.table.live if e.handle is not None)


@settings(max_examples=80, deadline=None)
@given(
    budget_executables=st.one_of(st.none(), st.integers(min_value=1, max_value=5)),
    families=st.integers(min_value=1, max_value=3),
    segments=st.lists(
        st.tuples(st.integers(1, 16), st.sampled_from([-2, -1, 1, 2, 3]), st.integers(1, 8)), min_size=1, max_size=12
    ),
    refused=st.sets(st.integers(min_value=1, max_value=16), max_size=3),
    lazy=st.booleans(),
    ahead=st.sampled_from([1, 3]),
)
def test_update_with_prefetching_runs_the_requested_graph_within_budget(
    budget_executables, families, segments, refused, lazy, ahead
):
    """`update` with prefetching under stepping runs mixed with jumps, refused updates included: every call gets
    its own graph, never from the executable just called or one held for a nearer predicted call; the charges stay
    within the budget; without a budget a family holds at most `ahead` + 1 executables; every prefetch is hit,
    wasted or still held."""
    driver = FakeDriver(refuse={f"L{n}" for n in refused}, background="lazy" if lazy else "done")
    cache, driver, graphs, memories = _keyed_cache(
        range(1, 17), budget_executables, driver, families=families, ahead=ahead
    )
    for n in _runs(segments, 16):
        _call(cache, driver, graphs, _ids(n))
        assert cache.accounting.over_budget == 0
        assert len(driver.running) == (_made(cache) if lazy else cache.executables)
        if budget_executables is None:
            per_family = Counter(cache.table.family(key) for key in cache.table.holder_keys())
            assert max(per_family.values()) <= ahead + 1, per_family
    assert cache.prefetcher.prefetches == cache.prefetcher.hits + cache.prefetcher.wasted + len(
        cache.table.pending_keys()
    )
    assert _total(memories, "executable_bytes") == cache.live_bytes


def _forecast_afresh(cache: ExecutableCache) -> list[Any]:
    """What `_predicted` must return: each of the next `ahead` keys predicted from the three before it, stopping at
    a failed prediction, an unregistered key or one called or predicted already."""
    keys = list(cache.prefetcher.forecast.calls)
    if len(keys) < 3:
        return []
    for _ in range(cache.prefetcher.forecast.ahead):
        key = next_in_step(*keys[-3:])
        if key is None or key not in cache.table.sources or key in keys:
            break
        keys.append(key)
    return keys[3:]


@settings(max_examples=60, deadline=None)
@given(
    segments=st.lists(
        st.tuples(st.integers(1, 30), st.sampled_from([-2, -1, 1, 2]), st.integers(1, 12)), min_size=1, max_size=10
    ),
    ahead=st.sampled_from([1, 4, 24]),
)
def test_the_forecast_carried_from_call_to_call_equals_one_made_afresh(segments, ahead):
    """`_predicted` extends the last forecast when a call came as forecast; whatever the calls, every forecast the
    cache makes is what predicting every key again gives, also after a graph in the forecast is discarded."""
    cache, driver, graphs, _ = _keyed_cache(range(1, 31), 6, ahead=ahead)
    carried = cache.prefetcher.forecast.predicted

    def checked() -> list[Any]:
        forecast = carried()
        assert forecast == _forecast_afresh(cache)
        return forecast

    cache.prefetcher.forecast.predicted = checked  # type: ignore[method-assign]
    for n in _runs(segments, 30):
        _call(cache, driver, graphs, _ids(n))
    forecast = cache.prefetcher.forecast.predicted()
    if len(forecast) >= 2:
        cache.discard(forecast[-1])
        _call(cache, driver, graphs, forecast[0])
