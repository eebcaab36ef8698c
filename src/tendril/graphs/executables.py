"""Executables of many graphs under a device-memory budget (the policy; plain Python, tested on the CPU).

Every instantiated CUDA graph holds device memory of the driver's own (on our H200: 0.83 MiB per GPT-2
forward graph on average, 0.9 MiB for a 289-node decode step, so about 3 KiB per node), on top of the
memory pool all graphs of a callable share. A callable
with one graph per sequence length spends most of its memory there. The captured graphs themselves
(`cudaGraph_t`) live on the host, so the executables can be managed apart from them:

- `dedicated`: one executable per graph, made at capture and kept (what `torch.cuda.graph` does). The
  CUDA backend serves it with torch's own replay; this cache is not involved.
- `lru`: executables are instantiated on demand; past the budget the least recently used is destroyed.
- `update` (opt-in): one executable per topology family (graphs whose node types, kernel functions and
  edges match, e.g. one model at different lengths); switching it to another graph of the family is a
  `cudaGraphExecUpdate` instead of an instantiation. On the H200 the update call takes 0.2 ms of host
  time for a GPT-2 forward, but a call that switches costs about 0.6 ms more than a dedicated
  executable's (`benchmarks/tools/graph_switch_cost.py`). And on driver 580 switching Wav2Vec2-base
  executables (kernel and memset nodes; functions matching) ended in an illegal instruction after a few
  switches, while the same graphs under `lru` ran 128 calls equal to dedicated executables and 7327
  GPT-2 updates were fine. Use it only for graphs shown to survive it.
- `auto` (the default): `dedicated` without a budget, `lru` with one (never `update`, for the reason above).

Every update is checked: CUDA refuses graphs whose topology or node kinds differ in ways the digest
does not see. A refused update destroys that executable, moves the graph into a family of its own and
instantiates it; the failure is counted in the graph's `GraphMemory`. Results are those of dedicated
executables: an executable updated to graph G runs exactly G's nodes and parameters.

Budget accounting. The driver's memory per executable is measured around each instantiation
(cudaMemGetInfo), but the driver takes it in chunks (one instantiation in several takes 2-4 MiB, the
others none), so a single measurement says little. The charge per executable is `nodes x rate`, with
the rate in bytes per node learnt from all measurements so far, starting from a prior of 4 KiB per
node worth `PRIOR_NODES` nodes of evidence. The budget holds for these charges; executables that may
not be evicted (`reserve`) count against it too. One executable larger than the budget is still
instantiated (a graph must run) and counted in `over_budget`.

Ordering. CUDA applies updates to later launches only and frees a destroyed executable after its running
launch completes (`tendril.cuda.graph_exec`); the CUDA driver of this policy still waits for an
executable's last launch before updating or destroying it (`CudaExecutables`). The memory the graphs
share is ordered by the stream (see `CudaBackend`).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

from tendril.cuda.graph_exec import Topology, UpdateOutcome
from tendril.graphs.stats import GraphMemory

PRIOR_BYTES_PER_NODE = 4096
"""Driver bytes per graph node assumed before any measurement (0.9 MiB / 289 nodes on the H200, rounded up)."""
PRIOR_NODES = 4096
"""How many nodes of evidence the prior is worth against measurements."""


class MemoryStrategy(str, enum.Enum):
    """How executables of a callable's graphs are kept (see the module docstring)."""

    AUTO = "auto"
    DEDICATED = "dedicated"
    LRU = "lru"
    UPDATE = "update"


def resolve_strategy(strategy: MemoryStrategy | str, budget: int | None) -> MemoryStrategy:
    """The strategy to run: `auto` means `dedicated` without a budget and `lru` with one."""
    try:
        chosen = MemoryStrategy(strategy)
    except ValueError:
        names = ", ".join(repr(s.value) for s in MemoryStrategy)
        raise ValueError(f"graph_memory_strategy={strategy!r}: expected one of {names}") from None
    if chosen is MemoryStrategy.DEDICATED and budget is not None:
        raise ValueError(
            "graph_memory_strategy='dedicated' keeps every executable and cannot hold a graph_memory_budget; "
            "use 'auto', 'lru' or 'update' with a budget, or drop the budget"
        )
    if chosen is MemoryStrategy.AUTO:
        return MemoryStrategy.DEDICATED if budget is None else MemoryStrategy.LRU
    return chosen


class ExecutableDriver(Protocol):
    """What the policy needs from CUDA (`tendril.graphs.cuda_backend.CudaExecutables`; a fake in tests)."""

    def instantiate(self, graph: Any) -> tuple[int, int | None]:
        """Instantiate `graph`; return the executable's handle and the driver bytes it took (None: unmeasured)."""

    def update(self, executable: int, graph: Any) -> UpdateOutcome:
        """Switch `executable` to `graph` for its later launches."""

    def destroy(self, executable: int) -> None:
        """Destroy `executable` (a launch still running completes first)."""


@dataclass
class _Executable:
    handle: int
    family: str
    nodes: int
    holder: Hashable
    """The key whose graph the executable runs now."""
    last_used: int


@dataclass
class _Source:
    graph: Any
    nodes: int
    family: str
    memory: GraphMemory


class ExecutableCache:
    """Gives each graph an executable on demand, within a device-memory budget (see the module docstring)."""

    def __init__(self, driver: ExecutableDriver, strategy: MemoryStrategy, budget: int | None) -> None:
        if strategy is MemoryStrategy.AUTO or (strategy is MemoryStrategy.DEDICATED and budget is None):
            raise ValueError("resolve the strategy first: 'auto' is 'dedicated' (served by torch) or 'lru'")
        self.driver = driver
        self.strategy = strategy
        self.budget = budget
        self.reserved_bytes = 0
        """Driver bytes of executables outside the cache (never evicted) that count against the budget."""
        self.over_budget = 0
        """Instantiations that left the charges above the budget (one executable larger than all of it)."""
        self._sources: dict[Hashable, _Source] = {}
        self._live: list[_Executable] = []
        self._families: dict[str, list[_Executable]] = {}
        """The live executables of each family (a switch looks at its graph's family only)."""
        self._holding: dict[Hashable, _Executable] = {}
        self._clock = 0
        self._measured_bytes = 0
        self._measured_nodes = 0
        self._splits = 0
        self._charged: int | None = 0
        """Sum of the live executables' charges; None when it must be recomputed (the live set or the rate
        changed). Updates change neither, so the per-call path of a switch stays O(family)."""

    # -- accounting ----------------------------------------------------------------------------------

    @property
    def bytes_per_node(self) -> float:
        """Learnt driver bytes per graph node (see the module docstring)."""
        prior = PRIOR_BYTES_PER_NODE * PRIOR_NODES
        return (self._measured_bytes + prior) / (self._measured_nodes + PRIOR_NODES)

    def charge(self, nodes: int) -> int:
        """Driver bytes charged to an executable of `nodes` nodes."""
        return math.ceil(nodes * self.bytes_per_node)

    @property
    def live_bytes(self) -> int:
        """Charges of the live executables plus reserved bytes; at most the budget (bar `over_budget`)."""
        if self._charged is None:
            self._charged = sum(self.charge(e.nodes) for e in self._live)
        return self._charged + self.reserved_bytes

    @property
    def executables(self) -> int:
        return len(self._live)

    def holder_keys(self) -> list[Hashable]:
        """Keys whose graph has an executable now, least recently used first."""
        return [e.holder for e in sorted(self._live, key=lambda e: e.last_used)]

    def family(self, key: Hashable) -> str:
        return self._sources[key].family

    def reserve(self, nbytes: int) -> None:
        """Count `nbytes` of executables kept outside the cache against the budget."""
        self.reserved_bytes += max(nbytes, 0)
        self._make_room(0)

    # -- graphs --------------------------------------------------------------------------------------

    def add(self, key: Hashable, graph: Any, topology: Topology, memory: GraphMemory) -> None:
        """Register a captured graph; it gets an executable at its first `acquire`."""
        if key in self._sources:
            raise ValueError(f"graph {key} is already registered")
        memory.strategy = self.strategy.value
        memory.family = topology.digest
        memory.nodes = topology.nodes
        self._sources[key] = _Source(graph, topology.nodes, topology.digest, memory)

    def acquire(self, key: Hashable) -> int:
        """The handle of an executable that runs `key`'s graph at its next launch (instantiated, switched or
        already there)."""
        self._clock += 1
        held = self._holding.get(key)
        if held is not None:
            held.last_used = self._clock
            return held.handle
        source = self._sources[key]
        start = time.perf_counter()
        executable = self._switch_or_instantiate(key, source)
        executable.last_used = self._clock
        source.memory.switch_ms += (time.perf_counter() - start) * 1e3
        return executable.handle

    def discard(self, key: Hashable) -> None:
        """Forget `key`'s graph (a capture that failed after registering), destroying its executable if any."""
        held = self._holding.get(key)
        if held is not None:
            self._evict(held)
        self._sources.pop(key, None)

    def close(self) -> None:
        """Destroy every executable (their running launches complete first)."""
        for executable in self._live:
            self.driver.destroy(executable.handle)
            self._sources[executable.holder].memory.executable_bytes = 0
        self._live.clear()
        self._families.clear()
        self._holding.clear()
        self._charged = 0

    # -- policy --------------------------------------------------------------------------------------

    def _switch_or_instantiate(self, key: Hashable, source: _Source) -> _Executable:
        if self.strategy is MemoryStrategy.LRU:
            return self._instantiate(key, source)
        family = self._families.get(source.family)
        if not family:
            return self._instantiate(key, source)
        target = min(family, key=lambda e: e.last_used)
        outcome = self.driver.update(target.handle, source.graph)
        if outcome.ok:
            self._sources[target.holder].memory.executable_bytes = 0
            del self._holding[target.holder]
            target.holder = key
            self._holding[key] = target
            source.memory.updates += 1
            source.memory.executable_bytes = self.charge(target.nodes)
            return target
        source.memory.update_failures += 1
        self._splits += 1
        source.family = f"{source.family}/{self._splits}"
        source.memory.family = source.family
        self._evict(target)
        return self._instantiate(key, source)

    def _instantiate(self, key: Hashable, source: _Source) -> _Executable:
        self._make_room(self.charge(source.nodes))
        handle, measured = self.driver.instantiate(source.graph)
        if measured is not None:
            self._measured_bytes += measured
            self._measured_nodes += source.nodes
        source.memory.instantiations += 1
        executable = _Executable(handle, source.family, source.nodes, key, self._clock)
        self._live.append(executable)
        self._families.setdefault(executable.family, []).append(executable)
        self._holding[key] = executable
        self._charged = None
        self._refresh_charges()
        if self.budget is not None and self.live_bytes > self.budget:
            self.over_budget += 1
        return executable

    def _make_room(self, needed: int) -> None:
        """Evict least recently used executables until `needed` more bytes fit the budget (or none is left)."""
        if self.budget is None:
            return
        while self._live and self.live_bytes + needed > self.budget:
            self._evict(min(self._live, key=lambda e: e.last_used))

    def _evict(self, executable: _Executable) -> None:
        self.driver.destroy(executable.handle)
        self._live.remove(executable)
        family = self._families[executable.family]
        family.remove(executable)
        if not family:
            del self._families[executable.family]
        self._charged = None
        del self._holding[executable.holder]
        memory = self._sources[executable.holder].memory
        memory.executable_bytes = 0
        memory.evictions += 1

    def _refresh_charges(self) -> None:
        for executable in self._live:
            self._sources[executable.holder].memory.executable_bytes = self.charge(executable.nodes)
