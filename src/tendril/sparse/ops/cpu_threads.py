"""Thread control and work splitting shared by the CPU operators.

The compiled kernels (`cpu_kernels.py`) run on numba's thread pool; `kernel_threads(n)` sets how many
of its threads a call may use (capped at the pool size, `NUMBA_NUM_THREADS`, which defaults to the
number of cores) and restores the previous count afterwards. Importing numba is deferred to the
first CPU-kernel call, so the GPU backends never need it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from types import ModuleType


def kernels() -> ModuleType:
    """The compiled CPU kernels (imports numba on first use)."""
    try:
        from tendril.sparse.ops import cpu_kernels
    except ImportError as error:
        raise ImportError(
            "the sparse CPU backend compiles its loops with numba, which is not installed: pip install numba"
        ) from error
    return cpu_kernels


@contextlib.contextmanager
def kernel_threads(threads: int) -> Iterator[int]:
    """Let the compiled kernels use `threads` threads (at most the pool size); yields the count used."""
    import numba

    if threads < 1:
        raise ValueError(f"threads={threads}: expected at least 1")
    previous = numba.get_num_threads()
    used = min(threads, numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    numba.set_num_threads(used)
    try:
        yield used
    finally:
        numba.set_num_threads(previous)


def balanced_ranges(work: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """Split `range(len(work))` into at most `parts` contiguous ranges of about equal total work."""
    total = sum(work)
    ranges: list[tuple[int, int]] = []
    first, done = 0, 0
    for i, cost in enumerate(work):
        done += cost
        if done * parts >= total * (len(ranges) + 1) and len(ranges) < parts - 1:
            ranges.append((first, i + 1))
            first = i + 1
    ranges.append((first, len(work)))
    return [r for r in ranges if r[0] < r[1]] or [(0, len(work))]
