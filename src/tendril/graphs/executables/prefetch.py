"""Prefetching: predict the next calls' keys and give their graphs executables on the background thread.

After each call (`Prefetcher.run`, not at the acquisitions made at capture) the cache predicts the key of the next
call from the last three (`predict_next`; the CUDA backend's steps every tensor shape by the amount the last two
calls did) and, looking `ahead` calls, each later one from the three before it. The next call's graph, if it has no
executable, gets one: an instantiation where there is room (made by evicting the least recently used, never the
executable just called nor one held for a predicted call), or without room an update of the least recently used
executable of its family other than those (on the background thread after that executable's last launch, then
uploaded in the predicting call's stream). A later predicted graph whose family holds fewer executables than its run
of calls needs (two for two calls or more in a row: one runs while the other is updated) is instantiated early
without evicting any of that family's, so a growing pass enters a family with its executables made.

A prefetched executable is pending (`ExecutableState.INSTANTIATING` or `UPDATING`) until a call takes it: the call
waits for its background operation (counted in `GraphMemory.prefetch_waits`; the wait counts in `switch_ms`, the
background time does not) and the operation's error is raised there. A refused background update is found when
taken: the graph moves into a family of its own and is instantiated on the calling thread. Background
instantiations are not measured (other threads' allocations would pollute cudaMemGetInfo) and are charged at the
learnt rate. Limits: the first three calls after a jump, and steps that change, are not predicted; random call
orders rarely step twice alike, so they rarely prefetch; a prefetch evicted before any call used it is counted as
wasted.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from tendril.graphs.executables.driver import PredictNext
from tendril.graphs.executables.entries import Executable, ExecutableState, ExecutableTable, Source

if TYPE_CHECKING:
    from tendril.graphs.executables.policy import ExecutableCache

PREFETCH_AHEAD = 3
"""Calls ahead the CUDA backend's cache predicts: a family a growing pass enters short of executables gets one
instantiated up to two calls before the call that needs it, since instantiating and uploading on the background
thread can take longer than a short call."""


class Forecast:
    """The keys of the last three calls and what was predicted from them.

    When a call comes as forecast, the rest of the forecast stands (each key was predicted from the same three
    before it, and passed checks that only lose the oldest call) and is extended from its end, so a growing pass
    predicts one key per call, not `ahead`. The forecast is dropped when graphs are registered or discarded."""

    def __init__(self, predict_next: PredictNext | None, ahead: int, registered: dict[Hashable, Source]) -> None:
        if ahead < 1:
            raise ValueError(f"ahead={ahead}: prefetching looks at least one call ahead")
        self.predict_next = predict_next
        self.ahead = ahead
        self.calls: deque[Hashable] = deque(maxlen=3)
        """Keys of the last calls, oldest first (what `predict_next` reads)."""
        self._registered = registered
        self._last: tuple[tuple[Hashable, ...], list[Hashable]] | None = None

    def record(self, key: Hashable) -> None:
        self.calls.append(key)

    def reset(self) -> None:
        self._last = None

    def forget(self, key: Hashable) -> None:
        self.calls = deque((k for k in self.calls if k != key), maxlen=3)
        self._last = None

    def predicted(self) -> list[Hashable]:
        """The registered keys of the next `ahead` calls, each predicted from the three calls before it (stops where
        the prediction fails, names an unregistered graph or one called or predicted already); none before three
        calls, or without `predict_next`."""
        if self.predict_next is None or len(self.calls) < 3:
            return []
        calls = tuple(self.calls)
        keys = list(calls)
        if self._last is not None:
            before, forecast = self._last
            if forecast and calls == (*before[1:], forecast[0]):
                keys += forecast[1:]
        while len(keys) < len(calls) + self.ahead:
            key = self.predict_next(*keys[-3:])
            if key is None or key not in self._registered or key in keys:
                break
            keys.append(key)
        forecast = keys[len(calls) :]
        self._last = (calls, forecast)
        return forecast


class Prefetcher:
    """Starts and takes the cache's background instantiations and updates (see the module docstring); its counters
    sum the graphs' `GraphMemory`."""

    def __init__(self, cache: ExecutableCache, predict_next: PredictNext | None, ahead: int) -> None:
        self._cache = cache
        self._table: ExecutableTable = cache.table
        self.forecast = Forecast(predict_next, ahead, cache.table.sources)

    @property
    def enabled(self) -> bool:
        """Whether the cache makes predicted executables on its background thread (if not, every driver call is made
        on the calling thread)."""
        return self.forecast.predict_next is not None

    @property
    def prefetches(self) -> int:
        """Instantiations and updates started in the background ahead of a predicted call."""
        return self._table.total("prefetches")

    @property
    def hits(self) -> int:
        """Calls that found their executable prefetched (ready or still being made)."""
        return self._table.total("prefetch_hits")

    @property
    def waits(self) -> int:
        """Calls that waited for their prefetched executable to be ready (a subset of the hits)."""
        return self._table.total("prefetch_waits")

    @property
    def wasted(self) -> int:
        """Prefetched executables evicted before any call used them."""
        return self._table.total("prefetch_wasted")

    def run(self, stream: Any) -> list[Hashable]:
        """After a call's launch: start the prefetches of the predicted calls, uploaded in `stream`; returns the
        keys prefetched. The host time spent here counts in those graphs' `switch_ms`."""
        predicted = self.forecast.predicted()
        if not predicted:
            return []
        holding = self._table.holding
        held = (holding.get(key) for key in (self.forecast.calls[-1], *predicted))
        protected = {executable for executable in held if executable is not None}
        started = []
        nearest = predicted[0]
        if nearest not in holding and self._start_timed(nearest, protected, stream):
            started.append(nearest)
        for index, key in enumerate(predicted[1:], start=1):
            if key in holding or not self._short_of_executables(key, predicted[:index]):
                continue
            family = set(self._table.members(self._table.sources[key].family))  # protected too: it instantiates
            if self._start_timed(key, protected | family, stream):
                started.append(key)
            break
        return started

    def claim(self, key: Hashable, held: Executable) -> Executable:
        """A call's pending executable: wait for it; a refused background update is destroyed and the graph
        instantiated on the calling thread."""
        source = self._table.sources[key]
        source.memory.prefetch_hits += 1
        assert held.background is not None
        if not held.background.done():
            source.memory.prefetch_waits += 1
        if self.take(held):
            return held
        self._cache.evict(held)
        return self._cache.instantiate(key, source)

    def take(self, executable: Executable) -> bool:
        """Wait for a pending executable's background operation; True when it now runs its holder's graph. A refused
        update gives False (counted, the graph split off), leaving the executable for the caller to destroy. A failed
        operation left nothing behind: the executable is forgotten and the error raised."""
        assert executable.pending and executable.background is not None
        updating = executable.state is ExecutableState.UPDATING
        try:
            result = executable.background.result()
        except Exception as error:
            self._table.forget(executable)
            executable.state = ExecutableState.DESTROYED
            doing = "updating an executable to" if updating else "instantiating"
            error.add_note(f"(raised on tendril's background thread {doing} graph {executable.holder})")
            raise
        executable.background = None
        executable.state = ExecutableState.READY
        source = self._table.sources[executable.holder]
        if not updating:
            executable.handle, measured = result
            self._table.learn(source.nodes, measured)
            return True
        if not result.ok:
            self._cache.split(source)
            return False
        source.memory.updates += 1
        return True

    def _start_timed(self, key: Hashable, protected: set[Executable], stream: Any) -> bool:
        """`_start`, its host time counted in the graph's `switch_ms`; a prefetch started joins `protected`."""
        source = self._table.sources[key]
        start = time.perf_counter()
        try:
            made = self._start(key, source, protected, stream)
        finally:
            source.memory.switch_ms += (time.perf_counter() - start) * 1e3
        if made:
            protected.add(self._table.holding[key])
        return made

    def _start(self, key: Hashable, source: Source, protected: set[Executable], stream: Any) -> bool:
        """Start giving `key`'s graph an executable in the background, leaving `protected` alone; False when that is
        impossible within the budget."""
        cache = self._cache
        if not cache.has_room(source, protected):
            target = cache.update_target(source.family, protected)
            if target is not None:
                self._update_in_background(key, source, target, stream)
                return True
            cache.clear_family(source.family, protected)
        accounting = cache.accounting
        needed = accounting.charge(source.nodes)
        if accounting.budget is not None:
            floor = accounting.reserved_bytes + sum(accounting.charge(e.nodes) for e in protected)
            if floor + needed > accounting.budget:
                return False  # only by evicting a protected executable
        cache.make_room(needed, protected)
        future = cache.driver.instantiate_async(source.graph, stream)
        state = ExecutableState.INSTANTIATING
        self._table.admit(Executable(None, source.family, source.nodes, key, cache.clock, state, future))
        source.memory.instantiations += 1
        source.memory.prefetches += 1
        return True

    def _update_in_background(self, key: Hashable, source: Source, target: Executable, stream: Any) -> None:
        """Queue the update of `target` to `key`'s graph; `target` is `key`'s (pending) from now on, so no call
        launches it before the update has completed. Its outcome is learnt when it is taken."""
        assert target.state is ExecutableState.READY
        target.background = self._cache.driver.update_async(target.handle, source.graph, stream)
        target.state = ExecutableState.UPDATING
        self._table.move_holder(target, key)
        target.last_used = self._cache.clock
        source.memory.prefetches += 1

    def _short_of_executables(self, key: Hashable, nearer: list[Hashable]) -> bool:
        """Whether `key`'s family holds fewer executables than the calls of it in a row up to `key` need (the call
        just made and the `nearer` predicted ones included): one, or two where the run has two calls or more."""
        sources = self._table.sources
        family = sources[key].family
        run = 1
        for previous in reversed([self.forecast.calls[-1], *nearer]):
            if sources[previous].family != family:
                break
            run += 1
        return len(self._table.members(family)) < min(run, 2)
