"""The executable cache: which graph has an executable, and what a call that finds none does.

A miss instantiates while the budget has room (without a budget: while the graph's family has no executable to
spare). Once it is full, a miss switches the least recently used executable of the graph's topology family to the
graph by `cudaGraphExecUpdate`; where the family has none that can be updated, it evicts and instantiates. Eviction
takes the least recently used executable, except that a family's last executable goes only once no family has one
to spare (`_eviction_order`): a later miss in a family that keeps one updates it, one in a family without must
instantiate on the calling thread, which costs several updates.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Hashable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait
from typing import Any

from tendril.cuda.graph_exec import Topology
from tendril.graphs.executables.accounting import Accounting
from tendril.graphs.executables.driver import ExecutableDriver, PredictNext
from tendril.graphs.executables.entries import Executable, ExecutableState, ExecutableTable, Source
from tendril.graphs.executables.prefetch import Prefetcher
from tendril.graphs.options import MemoryStrategy
from tendril.graphs.stats import GraphMemory


class ExecutableCache:
    """Gives each registered graph an executable on demand, within a device-memory budget (None: no budget; see
    the package docstring). `predict_next` turns prefetching on, `ahead` calls ahead (`Prefetcher`); the cache
    itself stays generic over hashable keys."""

    def __init__(
        self, driver: ExecutableDriver, budget: int | None, *, predict_next: PredictNext | None = None, ahead: int = 1
    ) -> None:
        self.driver = driver
        self.accounting = Accounting(budget)
        self.table = ExecutableTable(self.accounting)
        self.prefetcher = Prefetcher(self, predict_next, ahead)
        self.clock = 0
        """Counts acquisitions; an executable's `last_used` is the clock of its last call (or of the call that
        predicted it)."""
        self._splits = 0
        self._destroying: list[Future[None]] = []
        """Background destructions not yet seen to complete (their errors are raised at the next `acquire`)."""

    @property
    def live_bytes(self) -> int:
        """Charges of the live and pending executables plus reserved bytes; at most the budget (bar
        `Accounting.over_budget`)."""
        return self.table.live_bytes()

    @property
    def executables(self) -> int:
        """Live executables, pending prefetches included."""
        return len(self.table)

    def reserve(self, nbytes: int) -> None:
        """Count `nbytes` of executables kept outside the cache against the budget."""
        self.accounting.reserved_bytes += max(nbytes, 0)
        self.make_room(0)

    def add(self, key: Hashable, graph: Any, topology: Topology, memory: GraphMemory) -> None:
        """Register a captured graph; it gets an executable at its first `acquire`."""
        if key in self.table.sources:
            raise ValueError(f"graph {key} is already registered")
        memory.strategy = MemoryStrategy.UPDATE.value
        memory.family = topology.digest
        memory.nodes = topology.nodes
        self.table.sources[key] = Source(graph, topology.nodes, topology.digest, memory)
        self.prefetcher.forecast.reset()

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
        source = self.table.sources[key]
        start = time.perf_counter()
        outcome = self.driver.launch(executable.handle, stream, switch_to)
        if switch_to is not None:
            source.memory.switch_ms += (time.perf_counter() - start) * 1e3
            if outcome.ok:
                source.memory.updates += 1
            else:
                self.split(source)
                self.table.refile(executable, source.family)

    def prefetch_next(self, stream: Any = None) -> list[Hashable]:
        """After a call's launch: start the background work for the calls predicted next (`Prefetcher.run`)."""
        return self.prefetcher.run(stream)

    def wait_idle(self) -> None:
        """Wait until the background work started so far has finished (errors stay for `acquire` to raise)."""
        futures: list[Future[Any]] = [e.background for e in self.table if e.background is not None]
        futures_wait(futures + list[Future[Any]](self._destroying))

    def discard(self, key: Hashable) -> None:
        """Forget `key`'s graph (a capture that failed after registering), destroying its executable if any."""
        held = self.table.holding.get(key)
        if held is not None:
            self.evict(held)
        self.table.sources.pop(key, None)
        self.prefetcher.forecast.forget(key)

    def close(self) -> None:
        """Destroy every executable (their running launches complete first) and stop the background thread.

        A prefetch whose background operation failed left nothing to destroy; its error is dropped here."""
        for executable in list(self.table):
            if executable.pending:
                try:
                    self.prefetcher.take(executable)
                except Exception:  # nothing is left of it; no call is left to report the error to
                    continue
            self.driver.destroy(executable.handle)
            executable.state = ExecutableState.DESTROYED
        self.table.clear()
        self._destroying.clear()
        self.driver.close()

    # -- the policy, also used by the prefetcher ------------------------------------------------------

    def has_room(self, source: Source, protected: Collection[Executable] = ()) -> bool:
        """Whether `source`'s graph gets an executable of its own rather than an update. With a budget, while one
        more fits; without, while its family has no executable outside `protected` (so a family holds one
        executable, and one more prefetched for each predicted call)."""
        if self.accounting.budget is not None:
            return self.accounting.fits(self.live_bytes, self.accounting.charge(source.nodes))
        return all(e in protected for e in self.table.members(source.family))

    def update_target(self, family: str, protected: Collection[Executable] = ()) -> Executable | None:
        """The family's least recently used executable that may be updated now: ready, and not `protected`."""
        members = self.table.members(family)
        candidates = [e for e in members if e.state is ExecutableState.READY and e not in protected]
        return min(candidates, key=lambda e: e.last_used, default=None)

    def clear_family(self, family: str, protected: Collection[Executable] = ()) -> None:
        """Without a budget, evict `family`'s executables outside `protected` (all pending: nothing could be
        updated) so that an instantiation keeps it within `ahead` + 1 executables. With a budget, `make_room`
        decides."""
        if self.accounting.budget is not None:
            return
        for executable in [e for e in self.table.members(family) if e not in protected]:
            self.evict(executable)

    def make_room(self, needed: int, protected: Collection[Executable] = ()) -> None:
        """Evict executables until `needed` more bytes fit the budget (or only `protected` is left), in
        `_eviction_order` (a prefetch counts as used by the call that predicted it: a stale one ages out)."""
        if self.accounting.budget is None:
            return
        while not self.accounting.fits(self.live_bytes, needed):
            candidates = [e for e in self.table if e not in protected]
            if not candidates:
                return
            self.evict(min(candidates, key=self._eviction_order))

    def instantiate(self, key: Hashable, source: Source) -> Executable:
        """Instantiate `key`'s graph on the calling thread, measured, after making room for its charge."""
        self.make_room(self.accounting.charge(source.nodes))
        handle, measured = self.driver.instantiate(source.graph)
        self.table.learn(source.nodes, measured)
        source.memory.instantiations += 1
        executable = Executable(handle, source.family, source.nodes, key, self.clock)
        self.table.admit(executable)
        self.make_room(0, {executable})  # what it measured may have raised every charge past the budget
        if not self.accounting.fits(self.live_bytes, 0):
            self.accounting.over_budget += 1
        return executable

    def evict(self, executable: Executable) -> None:
        """Destroy `executable` after its last launch (in the background when prefetching); a pending one is
        waited for first and counted as wasted."""
        memory = self.table.sources[executable.holder].memory
        if executable.pending:
            memory.prefetch_wasted += 1
            self.prefetcher.take(executable)  # the handle, or the update's end (a failure is raised, not lost)
        assert executable.state is ExecutableState.READY
        if self.prefetcher.enabled:
            self._destroying.append(self.driver.destroy_async(executable.handle))
            executable.state = ExecutableState.DESTROYING
        else:
            self.driver.destroy(executable.handle)
            executable.state = ExecutableState.DESTROYED
        self.table.forget(executable)
        memory.evictions += 1

    def split(self, source: Source) -> None:
        """CUDA refused an update to `source`'s graph: count it and move the graph into a family of its own."""
        source.memory.update_failures += 1
        self._splits += 1
        source.family = f"{source.family}/{self._splits}"
        source.memory.family = source.family

    # -- internals -------------------------------------------------------------------------------------

    def _acquire(self, key: Hashable, *, call: bool, defer: bool) -> tuple[Executable, Any]:
        """`key`'s executable, and the graph it must be switched to at launch (None: it runs that graph already);
        without `defer` the switch is made here."""
        self.clock += 1
        self._raise_background_errors()
        if call:
            self.prefetcher.forecast.record(key)
        held = self.table.holding.get(key)
        if held is not None and held.state is ExecutableState.READY:
            held.last_used = self.clock
            return held, None
        source = self.table.sources[key]
        switch_to = None
        start = time.perf_counter()
        try:
            if held is not None:
                executable = self.prefetcher.claim(key, held)
            else:
                executable, switch_to = self._miss(key, source, defer)
        finally:
            source.memory.switch_ms += (time.perf_counter() - start) * 1e3
        executable.last_used = self.clock
        assert executable.state is ExecutableState.READY
        return executable, switch_to

    def _miss(self, key: Hashable, source: Source, defer: bool) -> tuple[Executable, Any]:
        """A call found no executable: instantiate with room, else update the family's least recently used
        executable (at launch, with `defer`: then the graph to switch to comes back); with no such executable,
        evict and instantiate."""
        if not self.has_room(source):
            target = self.update_target(source.family)
            if target is not None:
                if defer:
                    self.table.move_holder(target, key)
                    return target, source.graph
                return self._switch(key, source, target), None
            self.clear_family(source.family)
        return self.instantiate(key, source), None

    def _switch(self, key: Hashable, source: Source, target: Executable) -> Executable:
        assert target.state is ExecutableState.READY
        outcome = self.driver.update(target.handle, source.graph)
        if outcome.ok:
            self.table.move_holder(target, key)
            source.memory.updates += 1
            return target
        self.split(source)
        self.evict(target)
        return self.instantiate(key, source)

    def _eviction_order(self, executable: Executable) -> tuple[bool, int]:
        """Sort key of eviction candidates: executables of families that keep another first, then the least
        recently used."""
        last_of_family = len(self.table.members(executable.family)) == 1
        return last_of_family, executable.last_used

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
