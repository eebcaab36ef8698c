"""The graph-memory policy on the CPU: strategies, families, eviction order, budget accounting, update failures.

A fake driver stands in for CUDA: an "executable" is a handle that runs one fake graph; instantiating
takes `bytes_per_node` per node; an update is refused where the test says so. After every `acquire`
the handle returned must run exactly the requested graph (what makes results identical to dedicated
executables), must be alive, and the charges must stay within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tendril.cuda.graph_exec import Topology, UpdateOutcome
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import graphed
from tendril.graphs.executables import (
    PRIOR_BYTES_PER_NODE,
    ExecutableCache,
    MemoryStrategy,
    resolve_strategy,
)
from tendril.graphs.memory import parse_bytes
from tendril.graphs.stats import GraphMemory, GraphRecord, GraphStats

KIB = 1 << 10


@dataclass(frozen=True)
class FakeGraph:
    name: str
    nodes: int
    family: str

    @property
    def topology(self) -> Topology:
        return Topology(self.nodes, self.family)


class FakeDriver:
    def __init__(self, bytes_per_node: int = PRIOR_BYTES_PER_NODE, refuse: set[str] | None = None) -> None:
        self.bytes_per_node = bytes_per_node
        self.refuse = refuse or set()
        """Names of graphs an update to is refused (as CUDA refuses e.g. a 2D memset change)."""
        self.running: dict[int, FakeGraph] = {}
        self.destroyed: set[int] = set()
        self.log: list[tuple[str, str]] = []
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

    def destroy(self, executable: int) -> None:
        assert executable in self.running, "destroyed twice"
        del self.running[executable]
        self.destroyed.add(executable)
        self.log.append(("destroy", str(executable)))


def _cache(
    strategy: MemoryStrategy, budget: int | None, graphs: list[FakeGraph], driver: FakeDriver | None = None
) -> tuple[ExecutableCache, FakeDriver, dict[str, GraphMemory]]:
    driver = driver or FakeDriver()
    cache = ExecutableCache(driver, strategy, budget)
    memories = {}
    for graph in graphs:
        memories[graph.name] = GraphMemory()
        cache.add(graph.name, graph, graph.topology, memories[graph.name])
    return cache, driver, memories


def _acquire(cache: ExecutableCache, driver: FakeDriver, graphs: dict[str, FakeGraph], name: str) -> int:
    handle = cache.acquire(name)
    assert handle in driver.running, "acquire returned a destroyed executable"
    assert driver.running[handle] == graphs[name], "the executable does not run the requested graph"
    if cache.budget is not None and cache.over_budget == 0:
        assert cache.live_bytes <= cache.budget
    return handle


def _graphs(*specs: tuple[str, int, str]) -> dict[str, FakeGraph]:
    return {name: FakeGraph(name, nodes, family) for name, nodes, family in specs}


def test_strategy_resolution():
    assert resolve_strategy("auto", None) is MemoryStrategy.DEDICATED
    assert resolve_strategy("auto", 1 << 20) is MemoryStrategy.LRU
    assert resolve_strategy("lru", None) is MemoryStrategy.LRU
    assert resolve_strategy(MemoryStrategy.UPDATE, 5) is MemoryStrategy.UPDATE
    with pytest.raises(ValueError, match="'auto', 'dedicated', 'lru', 'update'"):
        resolve_strategy("smart", None)
    with pytest.raises(ValueError, match="cannot hold a graph_memory_budget"):
        resolve_strategy("dedicated", 1 << 20)
    with pytest.raises(ValueError, match="resolve the strategy first"):
        ExecutableCache(FakeDriver(), MemoryStrategy.AUTO, None)


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


def test_lru_evicts_the_least_recently_used_executable():
    graphs = _graphs(("a", 100, "f"), ("b", 100, "g"), ("c", 100, "h"), ("d", 100, "i"))
    budget = 2 * 100 * PRIOR_BYTES_PER_NODE  # two executables at the prior rate (the fake measures the same)
    cache, driver, memories = _cache(MemoryStrategy.LRU, budget, list(graphs.values()))
    for name in ("a", "b", "c"):
        _acquire(cache, driver, graphs, name)
    assert cache.holder_keys() == ["b", "c"] and memories["a"].evictions == 1
    _acquire(cache, driver, graphs, "b")  # a hit refreshes b
    _acquire(cache, driver, graphs, "d")
    assert cache.holder_keys() == ["b", "d"] and memories["c"].evictions == 1
    assert [op for op, _ in driver.log].count("update") == 0
    assert memories["b"].instantiations == 1 and memories["a"].executable_bytes == 0
    assert memories["d"].executable_bytes == 100 * PRIOR_BYTES_PER_NODE


def test_update_keeps_one_executable_per_family():
    graphs = _graphs(("L1", 50, "gpt"), ("L2", 50, "gpt"), ("L3", 50, "gpt"), ("W1", 80, "wav"), ("W2", 80, "wav"))
    cache, driver, memories = _cache(MemoryStrategy.UPDATE, None, list(graphs.values()))
    for name in ("L1", "L2", "W1", "L3", "W2", "L1", "L1"):
        _acquire(cache, driver, graphs, name)
    assert cache.executables == 2
    assert [name for op, name in driver.log if op == "instantiate"] == ["L1", "W1"]
    assert memories["L1"].updates == 1 and memories["L2"].updates == 1 and memories["W2"].updates == 1
    assert memories["L1"].executable_bytes > 0 and memories["L3"].executable_bytes == 0
    assert memories["L1"].family == "gpt" and memories["L1"].strategy == "update"


def test_auto_under_a_budget_never_updates():
    """`auto` with a budget is `lru`: executables of one family are instantiated and evicted, never switched by
    `cudaGraphExecUpdate` (which crashed Wav2Vec2-base executables on the H200)."""
    graphs = _graphs(("a1", 100, "A"), ("a2", 100, "A"), ("a3", 100, "A"), ("b1", 100, "B"))
    budget = 2 * 100 * PRIOR_BYTES_PER_NODE
    strategy = resolve_strategy("auto", budget)
    cache, driver, memories = _cache(strategy, budget, list(graphs.values()))
    for name in ("a1", "a2", "a3", "b1", "a1"):
        _acquire(cache, driver, graphs, name)
    assert strategy is MemoryStrategy.LRU and [op for op, _ in driver.log].count("update") == 0
    assert cache.holder_keys() == ["b1", "a1"] and memories["a1"].instantiations == 2
    assert cache.over_budget == 0


def test_a_refused_update_reinstantiates_in_a_family_of_its_own():
    graphs = _graphs(("x", 60, "F"), ("y", 60, "F"), ("z", 60, "F"))
    cache, driver, memories = _cache(MemoryStrategy.UPDATE, None, list(graphs.values()), FakeDriver(refuse={"y"}))
    _acquire(cache, driver, graphs, "x")
    _acquire(cache, driver, graphs, "y")  # refused: x's executable is destroyed, y instantiated apart
    assert memories["y"].update_failures == 1 and memories["y"].instantiations == 1
    assert memories["x"].evictions == 1 and cache.family("y") != cache.family("x")
    _acquire(cache, driver, graphs, "z")  # z's family has no executable now: instantiated
    _acquire(cache, driver, graphs, "x")  # x switches z's executable
    _acquire(cache, driver, graphs, "y")  # y has its own executable still
    assert memories["x"].updates == 1 and memories["y"].update_failures == 1
    assert [op for op, name in driver.log if name == "y"] == ["update", "instantiate"]


def test_budget_accounting_learns_the_driver_rate_and_counts_reservations():
    graphs = _graphs(("p", 1000, "P"), ("q", 1000, "Q"))
    heavy = FakeDriver(bytes_per_node=4 * PRIOR_BYTES_PER_NODE)
    cache, driver, _ = _cache(MemoryStrategy.LRU, 64 * 1000 * KIB, list(graphs.values()), heavy)
    before = cache.bytes_per_node
    _acquire(cache, driver, graphs, "p")
    assert cache.bytes_per_node > before  # measured more than the prior
    assert cache.charge(1000) == pytest.approx(1000 * cache.bytes_per_node, abs=1)
    cache.reserve(cache.budget)  # e.g. executables that must stay dedicated fill the budget
    assert cache.executables == 0 and cache.live_bytes == cache.budget
    _acquire(cache, driver, graphs, "q")  # a graph must still run: over budget, counted
    assert cache.over_budget == 1 and cache.executables == 1


def test_discard_and_close_destroy_executables():
    graphs = _graphs(("a", 10, "A"), ("b", 10, "B"))
    cache, driver, memories = _cache(MemoryStrategy.LRU, None, list(graphs.values()))
    _acquire(cache, driver, graphs, "a")
    _acquire(cache, driver, graphs, "b")
    cache.discard("a")
    assert cache.executables == 1 and len(driver.running) == 1
    cache.close()
    assert not driver.running and memories["b"].executable_bytes == 0


@settings(max_examples=60, deadline=None)
@given(
    strategy=st.sampled_from([MemoryStrategy.LRU, MemoryStrategy.UPDATE]),
    budget_graphs=st.integers(min_value=1, max_value=5),
    calls=st.lists(st.integers(min_value=0, max_value=11), min_size=1, max_size=80),
    refused=st.sets(st.integers(min_value=0, max_value=11), max_size=3),
)
def test_random_call_orders_always_run_the_requested_graph_within_budget(strategy, budget_graphs, calls, refused):
    specs = [(f"g{i}", 40 + 10 * (i % 3), f"F{i % 3}") for i in range(12)]  # three families of four
    graphs = _graphs(*specs)
    driver = FakeDriver(refuse={f"g{i}" for i in refused})
    budget = budget_graphs * 60 * PRIOR_BYTES_PER_NODE
    cache, driver, memories = _cache(strategy, budget, list(graphs.values()), driver)
    for index in calls:
        _acquire(cache, driver, graphs, f"g{index}")
        assert cache.over_budget == 0
        assert len(driver.running) == cache.executables
    assert sum(m.instantiations for m in memories.values()) >= 1
    assert sum(m.executable_bytes for m in memories.values()) == cache.live_bytes


def test_graphed_validates_memory_arguments_without_cuda():
    def double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with pytest.raises(ValueError, match="memory size"):
        graphed(double, graph_memory_budget="a lot")
    with pytest.raises(ValueError, match="graph_memory_strategy"):
        graphed(double, graph_memory_strategy="smart")
    with pytest.raises(ValueError, match="pass them to it"):
        graphed(double, backend=NullBackend(), graph_memory_budget="1MiB")
    fast = graphed(double, graph_memory_budget="16MiB", graph_memory_strategy="update")
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
