"""How fast a core runs when every core works at once, against one core working alone: the ceiling of thread scaling.

A CPU raises its clock when few cores are busy (turbo) and lowers it when all are, by an amount that depends on the
part, its power limits and, on a shared host, what other tenants run. So a program that scales perfectly still
speeds up by less than its thread count, and by a different amount on each host and day. This measures that amount:
each core runs the same chain of dependent floating-point operations (its time is cycles over clock, with no memory
traffic and nothing shared between cores), first one core alone, then every thread's chain at once. Their time
ratio is the clock ratio, and `threads * ratio` the speedup a perfectly parallel program could reach at those clocks.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tendril.sparse.ops import cpu_threads

CHAIN_STEPS = 8_000_000
"""Dependent operations per chain: tens of milliseconds at any clock, long enough for a turbo clock to settle."""


@dataclass(frozen=True)
class HostClock:
    threads: int
    one_ms: float
    """Median time of one chain on one thread, the other cores idle."""
    all_ms: float
    """Median time of `threads` chains, one per thread at once."""

    @property
    def ratio(self) -> float:
        """A core's speed with every thread busy over its speed alone (1.0: no turbo, or none lost)."""
        return self.one_ms / self.all_ms

    @property
    def scaling_ceiling(self) -> float:
        """The speedup of `threads` threads over one that a perfectly parallel program reaches at these clocks."""
        return self.threads * self.ratio


@functools.cache
def _chains() -> Callable[[np.ndarray, int], None]:
    """The chains as a numba parallel loop, one chain a thread, on the pool the sparse CPU engine uses."""
    cpu_threads.usable(1)  # starts numba's pool on the engine's threading layer before anything compiles
    import numba

    @numba.njit(parallel=True, cache=False)
    def chains(seeds: np.ndarray, steps: int) -> None:
        for t in numba.prange(seeds.shape[0]):
            x = seeds[t]
            for _ in range(steps):
                x = x * 0.9999999 + 1e-7
            seeds[t] = x

    return chains


def measure(threads: int, reps: int = 5, steps: int = CHAIN_STEPS) -> HostClock:
    """The host's clock ratio on `threads` threads (module docstring), medians of `reps` runs each way."""
    if threads < 1 or reps < 1 or steps < 1:
        raise ValueError(f"threads, reps and steps must be positive, got {threads}, {reps}, {steps}")
    chains = _chains()
    times: dict[int, list[float]] = {1: [], threads: []}
    for count in times:
        with cpu_threads.kernel_threads(count) as used:
            seeds = np.ones(used)
            chains(seeds, 1)  # compiled outside the timing
            for _ in range(reps):
                start = time.perf_counter()
                chains(seeds, steps)
                times[count].append((time.perf_counter() - start) * 1e3)
    used = cpu_threads.usable(threads)
    return HostClock(used, statistics.median(times[1]), statistics.median(times[threads]))
