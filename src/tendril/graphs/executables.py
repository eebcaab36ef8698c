"""Executables of many graphs under a device-memory budget (the policy; plain Python, tested on the CPU).

Every instantiated CUDA graph holds device memory of the driver's own (on our H200: 0.83 MiB per GPT-2
forward graph on average, 0.9 MiB for a 289-node decode step, so about 3 KiB per node), on top of the
memory pool all graphs of a callable share. A callable
with one graph per sequence length spends most of its memory there. The captured graphs themselves
(`cudaGraph_t`) live on the host, so the executables can be managed apart from them:

- `dedicated`: one executable per graph, made at capture and kept (what `torch.cuda.graph` does). The
  CUDA backend serves it with torch's own replay; this cache is not involved.
- `lru`: executables are instantiated on demand; past the budget the least recently used is destroyed.
  With a `predict_next` (the CUDA backend's default) it also prefetches: see below.
- `update`: `lru` while the budget has room; once it is full, a miss switches the least recently
  used executable of the graph's topology family (graphs whose node types, kernel launch configurations and
  edges match, e.g. one model at different lengths, whichever kernels cuBLAS picks: `graph_exec.Topology`) to
  the graph by `cudaGraphExecUpdate` instead of evicting and instantiating; where the family has no executable
  that can be updated (none, or only prefetches not yet taken), it evicts and instantiates as `lru` does,
  except that a family's last executable is evicted only once no family has one to spare (`_eviction_order`).
  Without a budget a family keeps one executable (and more prefetched for predicted calls). With a
  `predict_next` it prefetches too, by updating where it cannot instantiate: see below. A call's switch is
  left to its launch (`launch`): the CUDA driver cuts graphs into segments and updates each right before
  launching it, so the host's update of one segment overlaps the GPU's run of the one before (an update of a
  whole GPT-2 forward graph took 0.2 ms of host time on the H200, and a call that switched then cost about
  0.6 ms more than a dedicated executable's, `benchmarks/tools/graph_switch_cost.py`). Before families told
  cluster dimensions apart, switching Wav2Vec2-base executables ended in an illegal instruction on driver 580:
  a cuBLAS node ran one function with clusters (5, 1, 1) at one length and (2, 2, 1) at another, and CUDA
  accepted the update (`benchmarks/tools/graph_node_attributes.py`).
- `auto` (the default): `dedicated` without a budget, `update` with one. On the H200 (`graphs-memory`, GPT-2
  lengths 1..1024, 64 MiB budget) a call took 1.15x a dedicated executable's with lengths growing by one and
  1.13x / 1.20x in random order (two runs on different hosts: switching calls are host-bound), at 0.066 MiB of
  driver memory per extra graph; before a family kept its last executable (`_eviction_order`) 1.16-1.21x and
  1.21-1.23x (three runs), with families split by kernel function (184 of them instead of 49) and whole-graph
  updates on the calling thread 1.20x and 1.89x, under `lru` 1.57x and 2.49x. Wav2Vec2-base: 1.03x in random
  order (1.27x before). See "What limits the latency" below.

Every update is checked: CUDA refuses graphs whose topology or node kinds differ in ways the digest does
not see. A refused update destroys that executable, moves the graph into a family of its own and
instantiates it (a refused background update: when the call takes it); a switch refused at launch has
already run the graph (the driver instantiated the refused segments), and the executable moves into the new
family with it. The failure is counted in the graph's `GraphMemory`. Results are those of dedicated
executables: an executable updated to graph G runs exactly G's nodes and parameters.

Budget accounting. The driver's memory per executable is measured around each instantiation
(cudaMemGetInfo), but the driver takes it in chunks (one instantiation in several takes 2-4 MiB, the
others none), so a single measurement says little. The charge per executable is `nodes x rate`, with
the rate in bytes per node learnt from all measurements so far, starting from a prior of 4 KiB per
node worth `PRIOR_NODES` nodes of evidence. The budget holds for these charges; executables that may
not be evicted (`reserve`) count against it too. One executable larger than the budget is still
instantiated (a graph must run) and counted in `over_budget`.

Prefetching (`lru`, `update`). On the H200, for GPT-2 fp16 forward graphs of about 293 nodes
(`benchmarks/tools/instantiate_cost.py`), `cudaGraphInstantiateWithFlags` takes 1.34 ms of host time
(median, first time per graph), the first launch after it 0.27 ms more (the upload) and
`cudaGraphExecDestroy` 0.25 ms, against 0.90 ms for a call of a dedicated executable (launch and
synchronisation). A generation loop calls lengths growing by one, a cycle longer than any budgeted
cache, so plain `lru` misses at every call and pays about 1.9 ms extra per call. So after each call
(`prefetch_next`, not at the acquisition made at capture) the cache predicts the next call's key from
the last three calls (`predict_next`; the backend's understands `GraphKey`s: the last two transitions
stepped every tensor shape by the same amount, so the next key is the current one stepped once more).
If the prediction names a registered graph without an executable, room is made for it (least recently
used first, never the executable just called; skipped when even that would not fit the budget) and the
driver instantiates it on its background thread, uploading it on the stream of the call that predicted
it; evictions then destroy in the background too, after the executable's last launch. The diagnostic
measured what this can reach: a background thread instantiating and destroying without pause made 1523
pairs per second while a dedicated executable's loop slowed from 0.901 to 0.948 ms per call, and
prefetching the next length on one thread left 0.4% of calls waiting, at 1.0 ms per call (there the
foreground still paid the upload, which `upload` now moves to the worker). An `acquire` of a key whose
executable is still being made (or updated) waits for it (counted in `GraphMemory.prefetch_waits`; the
wait is part of `switch_ms`, the background time is not); errors of the background thread are raised
there, or at the next `acquire` for a background destroy. A pending executable counts against the budget
like a live one. Background instantiations are not measured (other threads' allocations would pollute
cudaMemGetInfo) and are charged at the learnt rate. Random call orders rarely step twice alike, so they
rarely prefetch; a prefetched executable evicted before any call used it is counted as wasted. Limits:
the first three calls after a jump (and steps that change) are not predicted; the background thread runs
in order, so a prefetch queued behind the destruction (or update) of an executable whose launch is still
running (host far ahead of the GPU, budget of few executables) waits for that launch; device memory may
exceed the charges briefly while destructions are queued (the budget is for the charges). Measured under
`lru` (`graphs-memory`, GPT-2 lengths 1..1024, 64 MiB budget, about 83 executables): 4014 of 4096 growing
calls found their executable prefetched, but 2239 of them waited for it, and a call took 1.57x a
dedicated executable's (target 1.05; 2.4x without prefetching). The background work per call is the
problem: `instantiate_cost.py` at lengths 1..1024 timed it on the worker at 0.71 ms to instantiate, 0.38
ms to upload and 0.22 ms to destroy, about as long as the call itself (1.50 ms on average, 0.9 ms at
short lengths); a second worker thread made it worse (the driver serialises the calls), and even the bare
loop of that tool reached only 1.13x. Random orders (2.5x) are not helped at all.

Prefetching under `update`. Without room (a full budget; without a budget, a family already holding an executable
other than the one just called) the prefetch updates the least recently used executable of the predicted graph's
family other than the one just called instead: on the background thread, after that executable's last launch, then
uploads it in the predicting call's stream. The executable is the predicted key's from then on (pending like a
prefetched instantiation; counted in `prefetches` and, once CUDA accepted it, in `updates`); a refused update is
found when it is taken. Where the family has no such executable, the prefetch is `lru`'s. At a full budget this
turns the background instantiation, upload and destruction into an update and an upload, and a random order's miss
into an update instead of an eviction and an instantiation (where the family has an executable to update). Looking
ahead (`ahead`, 3 calls in the CUDA backend): a later predicted graph whose family holds fewer executables than its
run of calls needs (one, or two for two calls or more in a row, which alternate) is instantiated without evicting
any of that family's, so a growing pass enters a family with its executables made up to two calls early; only the
next call's graph is ever updated. Measured (`graphs-memory`, as above): 4016 of 4096 growing calls found their
executable prefetched and 144 waited for it (217 before a family kept its last executable, 366 predicting one call
ahead with six equal segments). With every
executable resident (nothing switched) the cache's own cost per call is 1.02-1.04x
(`benchmarks/tools/update_prefetch_cost.py`, before segments), so what is left is the switching itself: the updated
executables' slower GPU time (above), the waits, and the host's work per call. Random lengths: nearly every call
switches at launch.

What limits the latency (H200, driver 580, GPT-2 lengths 1..1024; a switch is unavoidable at nearly every call,
since 64 MiB holds 55 of the 1024 executables):
- An updated executable runs slower on the GPU than a fresh one: 1.03-1.08x, the most at short lengths
  (`benchmarks/tools/update_pairs_cost.py`, 96 pairs of consecutive lengths of one family). It is the same whether
  or not the update swaps kernel functions (1.037x and 1.042x), and the update's host time is too (0.41 and 0.40
  ms per whole graph). An upload after the update, per-node `cuGraphExecKernelNodeSetParams`, or updating back to
  the graph it was instantiated from do not help (`update_cost.py`).
- A call that switches spends about 0.7-1.0 ms of host time in `launch` (updating and uploading each segment before
  launching it) against 0.05-0.12 ms for a dedicated executable's whole call (`executable_footprint.py`). Short
  calls (0.7-1 ms of GPU time) are host-bound on it.
- Bare loops without this cache's dispatch (`benchmarks/tools/switching_floor.py`, 90 MiB) reach 1.10x growing and
  1.15x random with one executable per family switched at launch, and 1.09x and 1.11x with the 156 shortest lengths
  kept for good (the tool counted 0.44 MiB per segmented executable; at the 1.2 MiB this cache's executables take,
  `executable_footprint.py`, those would not fit). Executables instantiated fresh on a worker for every call (24 or
  8 calls ahead) reach 1.09x at best, and still 1.05x at lengths 513-1024, where two thirds of the time goes (the
  worker's contention alone cost nothing there). Instantiating segmented executables there (what a `fresh`
  prefetching mode of this cache did, since removed) cannot keep up: about 2 ms of worker time per call, and
  `graphs-memory` went to 1.80x growing.
So `graphs-memory`'s growing target (1.05x) is below what any of these ways of switching reached at the driver memory
its other target allows (0.1 MiB per extra graph, about 85 of this cache's executables): two thirds of the time is
spent at lengths 513-1024, where updated executables ran 1.03x slower on the GPU alone and fresh ones 1.05x. Random
orders (target 1.15x) depend on the host's speed through the switching call's host time.

Limit of the accounting: executables recycle driver memory that destroyed ones freed (another callable's
too), and such instantiations measure no growth; the learnt rate then falls and more executables fit the
budget than its bytes would hold fresh (seen in a first version of `update_prefetch_cost.py`, whose callables
followed each other in one process: 256 GPT-2 executables fit a 16 MiB budget). An instantiation that measures
more than the learnt rate raises every charge; the least recently used are then evicted until they fit. The
driver never gives executable memory back to the device: destroying every executable freed nothing that
cudaMemGetInfo sees, and a churn through all 1024 GPT-2 graphs keeping 55 alive took none beyond it
(`executable_footprint.py`). The device's footprint is therefore the high-water mark of the live executables,
which the budget bounds, plus any brief excess while destructions are queued.

Ordering. CUDA applies updates to later launches only and frees a destroyed executable after its running
launch completes (`tendril.cuda.graph_exec`); the CUDA driver of this policy still waits for an
executable's last launch before updating or destroying it (`CudaExecutables`). The memory the graphs
share is ordered by the stream (see `CudaBackend`).
"""

from __future__ import annotations

import enum
import math
import time
from collections import deque
from collections.abc import Callable, Collection, Hashable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
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
    """The strategy to run: `auto` means `dedicated` without a budget and `update` with one."""
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
        return MemoryStrategy.DEDICATED if budget is None else MemoryStrategy.UPDATE
    return chosen


PredictNext = Callable[[Hashable, Hashable, Hashable], Hashable | None]
"""Given the keys of the last three calls (oldest first), the key the next call is expected to have, or None."""


class ExecutableDriver(Protocol):
    """What the policy needs from CUDA (`tendril.graphs.cuda_backend.CudaExecutables`; a fake in tests).

    The `_async` operations run in submission order on one background thread; their errors are raised by the
    futures' `result()`."""

    def instantiate(self, graph: Any) -> tuple[Any, int | None]:
        """Instantiate `graph`; return the executable's handle and the driver bytes it took (None: unmeasured)."""

    def update(self, executable: Any, graph: Any) -> UpdateOutcome:
        """Switch `executable` to `graph` for its later launches."""

    def launch(self, executable: Any, stream: Any, switch_to: Any = None) -> UpdateOutcome:
        """Launch `executable` in `stream`; with `switch_to`, switch it to that graph first (the CUDA driver does
        it piece by piece, each piece right before its launch). The launch runs `switch_to` even where CUDA
        refuses the update (the driver instantiates what it refused); the outcome says whether it refused."""

    def destroy(self, executable: Any) -> None:
        """Destroy `executable` (a launch still running completes first)."""

    def instantiate_async(self, graph: Any, stream: Any) -> Future[tuple[Any, int | None]]:
        """Instantiate `graph` in the background (and upload it in `stream`, the stream of the call that asked
        for it, if not None); the future gives what `instantiate` returns."""

    def update_async(self, executable: Any, graph: Any, stream: Any) -> Future[UpdateOutcome]:
        """Switch `executable` to `graph` in the background, once its last launch has completed, and upload it in
        `stream` (if not None) when the update succeeded; the future gives what `update` returns. If the
        operation raises, `executable` is destroyed first."""

    def destroy_async(self, executable: Any) -> Future[None]:
        """Destroy `executable` in the background, once its last launch has completed."""

    def close(self) -> None:
        """Finish the background work and stop the background thread."""


@dataclass(eq=False)
class _Executable:
    handle: Any
    """The driver's handle (the CUDA backend's is an `ExecutableChain`); None while its instantiation is
    `pending`."""
    family: str
    nodes: int
    holder: Hashable
    """The key whose graph the executable runs now (or will, once `pending` has completed)."""
    last_used: int
    pending: Future[Any] | None = None
    """A prefetch no call has taken yet (it may still run): the instantiation of the holder's graph (its future
    gives the handle and the measured bytes) or, when `handle` is set, the update of this executable to that
    graph (its future gives the `UpdateOutcome`)."""

    @property
    def updating(self) -> bool:
        """Whether `pending` is a background update (of an executable that exists) rather than an instantiation."""
        return self.pending is not None and self.handle is not None


@dataclass
class _Source:
    graph: Any
    nodes: int
    family: str
    memory: GraphMemory


class ExecutableCache:
    """Gives each graph an executable on demand, within a device-memory budget (see the module docstring).

    `predict_next` turns prefetching on (strategies `lru` and `update`); the cache itself stays generic over
    hashable keys."""

    def __init__(
        self,
        driver: ExecutableDriver,
        strategy: MemoryStrategy,
        budget: int | None,
        *,
        predict_next: PredictNext | None = None,
        ahead: int = 1,
    ) -> None:
        if strategy is MemoryStrategy.AUTO or (strategy is MemoryStrategy.DEDICATED and budget is None):
            raise ValueError("resolve the strategy first: 'auto' is 'dedicated' (served by torch) or 'update'")
        self.driver = driver
        self.strategy = strategy
        self.budget = budget
        self.predict_next = predict_next if strategy in (MemoryStrategy.LRU, MemoryStrategy.UPDATE) else None
        """How the next call's key is predicted; None: no prefetching (and every driver call on the caller's thread)."""
        if ahead < 1:
            raise ValueError(f"ahead={ahead}: prefetching looks at least one call ahead")
        self.ahead = ahead
        """How many calls ahead `prefetch_next` predicts, each from the ones before (beyond the next call, only under
        `update`: to instantiate early for a family short of executables)."""
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
        """Sum of the live executables' charges, kept as executables come and go; None when it must be recomputed
        (the learnt rate changed). Updates change neither, so the per-call path of a switch stays O(family)."""
        self._calls: deque[Hashable] = deque(maxlen=3)
        """Keys of the last calls, oldest first (what `predict_next` reads)."""
        self._forecast: tuple[tuple[Hashable, ...], list[Hashable]] | None = None
        """The last calls `_predicted` read and what it predicted from them: when the next call is the first key
        predicted, the rest of the forecast stands (each key was predicted from the same three before it, and passed
        checks that only lose the oldest call) and is extended from its end, so a growing pass predicts one key per
        call, not `ahead`. Forgotten when graphs are registered or discarded."""
        self._destroying: list[Future[None]] = []
        """Background destructions not yet seen to complete (their errors are raised at the next `acquire`)."""

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
        """Charges of the live and pending executables plus reserved bytes; at most the budget (bar
        `over_budget`)."""
        if self._charged is None:
            self._charged = sum(self.charge(e.nodes) for e in self._live)
        return self._charged + self.reserved_bytes

    @property
    def executables(self) -> int:
        """Live executables, pending prefetches included."""
        return len(self._live)

    @property
    def prefetching(self) -> bool:
        return self.predict_next is not None

    @property
    def prefetches(self) -> int:
        """Instantiations and updates started in the background ahead of a predicted call."""
        return sum(source.memory.prefetches for source in self._sources.values())

    @property
    def prefetch_hits(self) -> int:
        """Calls that found their executable prefetched (ready or still being made)."""
        return sum(source.memory.prefetch_hits for source in self._sources.values())

    @property
    def prefetch_waits(self) -> int:
        """Calls that waited for their prefetched executable to be ready (a subset of the hits)."""
        return sum(source.memory.prefetch_waits for source in self._sources.values())

    @property
    def prefetch_wasted(self) -> int:
        """Prefetched executables evicted before any call used them."""
        return sum(source.memory.prefetch_wasted for source in self._sources.values())

    def holder_keys(self) -> list[Hashable]:
        """Keys whose graph has an executable now (pending prefetches included), least recently used first."""
        return [e.holder for e in sorted(self._live, key=lambda e: e.last_used)]

    def pending_keys(self) -> list[Hashable]:
        """Keys whose prefetched executable no call has taken yet."""
        return [e.holder for e in self._live if e.pending is not None]

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
        self._forecast = None

    def acquire(self, key: Hashable, *, call: bool = True) -> Any:
        """The handle of an executable that runs `key`'s graph at its next launch (instantiated, switched, taken
        from a prefetch, or already there). `call=False` for an acquisition that is not a call (at capture): it
        does not count towards prediction. Raises the error of a failed background instantiation, update or
        destruction."""
        executable, _ = self._acquire(key, call=call, defer=False)
        return executable.handle

    def launch(self, key: Hashable, stream: Any) -> None:
        """A call: acquire `key`'s executable and launch it in `stream`. A switch by update is left to the launch
        (`ExecutableDriver.launch`), which the CUDA driver pipelines segment by segment; if CUDA refused it, the
        launch still ran the graph (the driver instantiated what was refused) and the graph moves into a family
        of its own, with the executable that now runs it."""
        executable, switch_to = self._acquire(key, call=True, defer=True)
        source = self._sources[key]
        start = time.perf_counter()
        outcome = self.driver.launch(executable.handle, stream, switch_to)
        if switch_to is not None:
            source.memory.switch_ms += (time.perf_counter() - start) * 1e3
            if outcome.ok:
                source.memory.updates += 1
            else:
                self._split(source)
                self._refile(executable, source.family)

    def _acquire(self, key: Hashable, *, call: bool, defer: bool) -> tuple[_Executable, Any]:
        """`key`'s executable, and the graph it must be switched to at launch (None: it runs that graph already);
        without `defer` the switch is made here."""
        self._clock += 1
        self._raise_background_errors()
        if call:
            self._calls.append(key)
        held = self._holding.get(key)
        if held is not None and held.pending is None:
            held.last_used = self._clock
            return held, None
        source = self._sources[key]
        switch_to = None
        start = time.perf_counter()
        try:
            if held is not None:
                assert held.pending is not None
                source.memory.prefetch_hits += 1
                if not held.pending.done():
                    source.memory.prefetch_waits += 1
                executable = held if self._take(held) else self._replace_refused(key, source, held)
            else:
                executable, switch_to = self._switch_or_instantiate(key, source, defer)
        finally:
            source.memory.switch_ms += (time.perf_counter() - start) * 1e3
        executable.last_used = self._clock
        assert executable.handle is not None
        return executable, switch_to

    def prefetch_next(self, stream: Any = None) -> list[Hashable]:
        """After a call's launch: predict the keys of the next `ahead` calls and start giving their graphs executables
        in the background, uploaded in `stream`, never taking the executable just called or one held for a predicted
        call. The next call's graph, if it has no executable: an instantiation where there is room (made by evicting,
        under `lru`), or under `update` without room an update of one of its family's executables. Under `update`,
        also the first later predicted graph whose family holds fewer executables than its run needs (two for two
        calls or more in a row, which then alternate: one runs while the other is updated), by an instantiation that
        evicts none of that family's (`_short_of_executables`): a growing pass then enters a family with its
        executables made calls ahead instead of waiting for an instantiation. Returns the keys prefetched; the host
        time spent here counts in those graphs' `switch_ms`."""
        predicted = self._predicted()
        if not predicted:
            return []
        held = (self._holding.get(key) for key in (self._calls[-1], *predicted))
        protected = {executable for executable in held if executable is not None}
        started = []
        nearest = predicted[0]
        if nearest not in self._holding and self._prefetch_timed(nearest, protected, stream):
            started.append(nearest)
        if self.strategy is not MemoryStrategy.UPDATE:
            return started
        for index, key in enumerate(predicted[1:], start=1):
            if key in self._holding or not self._short_of_executables(key, predicted[:index]):
                continue
            family = set(self._families.get(self._sources[key].family, ()))  # protected too: it instantiates
            if self._prefetch_timed(key, protected | family, stream):
                started.append(key)
            break
        return started

    def _prefetch_timed(self, key: Hashable, protected: set[_Executable], stream: Any) -> bool:
        """`_prefetch`, its host time counted in the graph's `switch_ms`; a prefetch started joins `protected`."""
        source = self._sources[key]
        start = time.perf_counter()
        try:
            made = self._prefetch(key, source, protected, stream)
        finally:
            source.memory.switch_ms += (time.perf_counter() - start) * 1e3
        if made:
            protected.add(self._holding[key])
        return made

    def _short_of_executables(self, key: Hashable, nearer: list[Hashable]) -> bool:
        """Whether `key`'s family holds fewer executables than the calls of it in a row up to `key` need (the call
        just made and the `nearer` predicted ones included): one, or two where the run has two calls or more."""
        family = self._sources[key].family
        run = 1
        for previous in reversed([self._calls[-1], *nearer]):
            if self._sources[previous].family != family:
                break
            run += 1
        return len(self._families.get(family, ())) < min(run, 2)

    def _predicted(self) -> list[Hashable]:
        """The registered keys of the next `ahead` calls, each predicted from the three calls before it (stops where
        the prediction fails, names an unregistered graph or one called or predicted already); none before three
        calls, or without `predict_next`."""
        if self.predict_next is None or len(self._calls) < 3:
            return []
        calls = tuple(self._calls)
        keys = list(calls)
        if self._forecast is not None:
            before, forecast = self._forecast
            if forecast and calls == (*before[1:], forecast[0]):
                keys += forecast[1:]  # the call came as forecast: the rest stands, predicted from the same keys
        while len(keys) < len(calls) + self.ahead:
            key = self.predict_next(*keys[-3:])
            if key is None or key not in self._sources or key in keys:
                break
            keys.append(key)
        forecast = keys[len(calls) :]
        self._forecast = (calls, forecast)
        return forecast

    def wait_idle(self) -> None:
        """Wait until the background work started so far has finished (errors stay for `acquire` to raise)."""
        futures: list[Future[Any]] = [e.pending for e in self._live if e.pending is not None]
        futures_wait(futures + list[Future[Any]](self._destroying))

    def discard(self, key: Hashable) -> None:
        """Forget `key`'s graph (a capture that failed after registering), destroying its executable if any."""
        held = self._holding.get(key)
        if held is not None:
            self._evict(held)
        self._sources.pop(key, None)
        self._calls = deque((k for k in self._calls if k != key), maxlen=3)
        self._forecast = None

    def close(self) -> None:
        """Destroy every executable (their running launches complete first) and stop the background thread.

        A prefetch whose background operation failed left nothing to destroy; its error is dropped here."""
        for executable in list(self._live):
            if executable.pending is not None:
                try:
                    self._take(executable)
                except Exception:  # nothing is left of it; no call is left to report the error to
                    continue
            assert executable.handle is not None
            self.driver.destroy(executable.handle)
            self._sources[executable.holder].memory.executable_bytes = 0
        self._live.clear()
        self._families.clear()
        self._holding.clear()
        self._charged = 0
        self._destroying.clear()
        self.driver.close()

    # -- policy --------------------------------------------------------------------------------------

    def _switch_or_instantiate(self, key: Hashable, source: _Source, defer: bool) -> tuple[_Executable, Any]:
        """A call's miss: instantiate (`lru`, or `update` with room), else update the family's least recently used
        executable (at launch, with `defer`: then the graph to switch to comes back); with no such executable,
        `lru`'s way (evict, instantiate)."""
        if self.strategy is MemoryStrategy.UPDATE and not self._has_room(source):
            target = self._update_target(source.family)
            if target is not None:
                if defer:
                    self._move_holder(target, key)
                    return target, source.graph
                return self._switch(key, source, target), None
            self._clear_family(source.family)
        return self._instantiate(key, source), None

    def _switch(self, key: Hashable, source: _Source, target: _Executable) -> _Executable:
        assert target.handle is not None and target.pending is None
        outcome = self.driver.update(target.handle, source.graph)
        if outcome.ok:
            self._move_holder(target, key)
            source.memory.updates += 1
            return target
        self._split(source)
        self._evict(target)
        return self._instantiate(key, source)

    def _refile(self, executable: _Executable, family: str) -> None:
        """Move `executable` into `family` (its graph's, after a split)."""
        members = self._families[executable.family]
        members.remove(executable)
        if not members:
            del self._families[executable.family]
        executable.family = family
        self._families.setdefault(family, []).append(executable)

    def _prefetch(self, key: Hashable, source: _Source, protected: set[_Executable], stream: Any) -> bool:
        """Start giving `key`'s graph an executable in the background, leaving `protected` (the executable just
        called, and those held for predicted calls) alone; False when that is impossible within the budget."""
        if self.strategy is MemoryStrategy.UPDATE and not self._has_room(source, protected):
            target = self._update_target(source.family, protected)
            if target is not None:
                self._switch_in_background(key, source, target, stream)
                return True
            self._clear_family(source.family, protected)
        needed = self.charge(source.nodes)
        if self.budget is not None:
            floor = self.reserved_bytes + sum(self.charge(e.nodes) for e in protected)
            if floor + needed > self.budget:
                return False  # only by evicting a protected executable
        self._make_room(needed, protected)
        future = self.driver.instantiate_async(source.graph, stream)
        self._admit(_Executable(None, source.family, source.nodes, key, self._clock, future))
        source.memory.instantiations += 1
        source.memory.prefetches += 1
        return True

    def _switch_in_background(self, key: Hashable, source: _Source, target: _Executable, stream: Any) -> None:
        """Queue the update of `target` to `key`'s graph; `target` is `key`'s (pending) from now on, so no call
        launches it before the update has completed. Its outcome is learnt when it is taken (`_take`)."""
        assert target.handle is not None and target.pending is None
        target.pending = self.driver.update_async(target.handle, source.graph, stream)
        self._move_holder(target, key)
        target.last_used = self._clock
        source.memory.prefetches += 1

    def _has_room(self, source: _Source, protected: Collection[_Executable] = ()) -> bool:
        """Under `update`: whether `source`'s graph gets an executable of its own rather than an update. With a
        budget, while one more fits; without, while its family has no executable outside `protected` (so a
        family holds one executable, and one more prefetched for each predicted call: `ahead`)."""
        if self.budget is not None:
            return self.live_bytes + self.charge(source.nodes) <= self.budget
        return all(e in protected for e in self._families.get(source.family, ()))

    def _update_target(self, family: str, protected: Collection[_Executable] = ()) -> _Executable | None:
        """The family's least recently used executable that may be updated now: made (not pending), and not
        `protected`."""
        candidates = [e for e in self._families.get(family, ()) if e.pending is None and e not in protected]
        return min(candidates, key=lambda e: e.last_used, default=None)

    def _clear_family(self, family: str, protected: Collection[_Executable] = ()) -> None:
        """Without a budget, evict `family`'s executables outside `protected` (all pending: nothing could be
        updated) so that an instantiation keeps it within `ahead` + 1 executables. With a budget, `_make_room`
        decides."""
        if self.budget is not None:
            return
        for executable in [e for e in self._families.get(family, ()) if e not in protected]:
            self._evict(executable)

    def _replace_refused(self, key: Hashable, source: _Source, refused: _Executable) -> _Executable:
        """A call took a background update that CUDA refused (`_take` split the family): destroy that executable
        and instantiate the graph on the calling thread."""
        self._evict(refused)
        return self._instantiate(key, source)

    def _split(self, source: _Source) -> None:
        """CUDA refused an update to `source`'s graph: count it and move the graph into a family of its own."""
        source.memory.update_failures += 1
        self._splits += 1
        source.family = f"{source.family}/{self._splits}"
        source.memory.family = source.family

    def _move_holder(self, executable: _Executable, key: Hashable) -> None:
        self._sources[executable.holder].memory.executable_bytes = 0
        del self._holding[executable.holder]
        executable.holder = key
        self._holding[key] = executable
        self._sources[key].memory.executable_bytes = self.charge(executable.nodes)

    def _instantiate(self, key: Hashable, source: _Source) -> _Executable:
        self._make_room(self.charge(source.nodes))
        handle, measured = self.driver.instantiate(source.graph)
        self._learn(source, measured)
        source.memory.instantiations += 1
        executable = _Executable(handle, source.family, source.nodes, key, self._clock)
        self._admit(executable)
        self._make_room(0, {executable})  # what it measured may have raised every charge past the budget
        if self.budget is not None and self.live_bytes > self.budget:
            self.over_budget += 1
        return executable

    def _admit(self, executable: _Executable) -> None:
        self._live.append(executable)
        self._families.setdefault(executable.family, []).append(executable)
        self._holding[executable.holder] = executable
        charge = self.charge(executable.nodes)
        if self._charged is not None:
            self._charged += charge
        self._sources[executable.holder].memory.executable_bytes = charge

    def _learn(self, source: _Source, measured: int | None) -> None:
        """Add a measurement to the learnt rate; every charge changes with it."""
        if measured is not None:
            self._measured_bytes += measured
            self._measured_nodes += source.nodes
            self._charged = None
            self._refresh_charges()

    def _take(self, executable: _Executable) -> bool:
        """Wait for a prefetch; True when the executable now runs its holder's graph. A refused background update
        gives False (counted, the graph split off: `_split`), leaving the executable for the caller to destroy. A
        failed background operation left nothing behind: the executable is forgotten and the error raised."""
        assert executable.pending is not None
        updating = executable.updating
        try:
            result = executable.pending.result()
        except Exception as error:
            self._forget(executable)
            doing = "updating an executable to" if updating else "instantiating"
            error.add_note(f"(raised on tendril's background thread {doing} graph {executable.holder})")
            raise
        executable.pending = None
        source = self._sources[executable.holder]
        if not updating:
            executable.handle, measured = result
            self._learn(source, measured)
            return True
        if not result.ok:
            self._split(source)
            return False
        source.memory.updates += 1
        return True

    def _make_room(self, needed: int, protected: Collection[_Executable] = ()) -> None:
        """Evict executables until `needed` more bytes fit the budget (or only `protected` is left), the least
        recently used first (a prefetch counts as used by the call that predicted it: a stale one ages out). Under
        `update`, a family's last executable goes only once no family has one to spare (`_eviction_order`)."""
        if self.budget is None:
            return
        while self.live_bytes + needed > self.budget:
            candidates = [e for e in self._live if e not in protected]
            if not candidates:
                return
            self._evict(min(candidates, key=self._eviction_order))

    def _eviction_order(self, executable: _Executable) -> tuple[bool, int]:
        """Sort key of eviction candidates. Under `update` a miss in a family that keeps an executable switches it by
        an update, but one in a family without must instantiate on the calling thread (about 1.6 ms with the upload
        for a GPT-2 forward, against the update's 0.4 ms), so executables of families that keep another go first.
        Pure least-recently-used order let a growing pass over GPT-2's 1024 lengths (55 executables, 49 families)
        leave 28 families with executables; the random calls after it then instantiated 46 times in their first
        pass and 13 in each later one, every instantiation evicting another family's last executable (a CPU
        simulation with the case's counts: `test_a_family_keeps_its_last_executable_while_others_have_spares`)."""
        last_of_family = self.strategy is MemoryStrategy.UPDATE and len(self._families[executable.family]) == 1
        return last_of_family, executable.last_used

    def _evict(self, executable: _Executable) -> None:
        memory = self._sources[executable.holder].memory
        if executable.pending is not None:
            memory.prefetch_wasted += 1
            self._take(executable)  # the handle, or the update's end (a failure is raised, not lost)
        assert executable.handle is not None
        if self.prefetching:
            self._destroying.append(self.driver.destroy_async(executable.handle))
        else:
            self.driver.destroy(executable.handle)
        self._forget(executable)
        memory.evictions += 1

    def _forget(self, executable: _Executable) -> None:
        self._live.remove(executable)
        family = self._families[executable.family]
        family.remove(executable)
        if not family:
            del self._families[executable.family]
        if self._charged is not None:
            self._charged -= self.charge(executable.nodes)  # the rate is the one the sum was made at
        del self._holding[executable.holder]
        self._sources[executable.holder].memory.executable_bytes = 0

    def _raise_background_errors(self) -> None:
        """Raise the error of a background destruction that failed (CUDA errors are sticky: the next call would
        fail anyway, here it fails naming the cause)."""
        if not self._destroying:
            return
        finished: list[Future[None]] = []
        running: list[Future[None]] = []
        for future in self._destroying:
            (finished if future.done() else running).append(future)
        self._destroying = running
        for future in finished:
            future.result()

    def _refresh_charges(self) -> None:
        for executable in self._live:
            self._sources[executable.holder].memory.executable_bytes = self.charge(executable.nodes)
