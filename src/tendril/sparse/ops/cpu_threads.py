"""Thread control shared by the CPU operators.

The compiled kernels (`cpu_kernels.py`) run on numba's thread pool, the library calls (torch's sparse
BLAS) on torch's; `kernel_threads(n)` sets how many threads of each a call may use (numba's capped at
its pool size, `NUMBA_NUM_THREADS`, which defaults to the number of cores) and restores the previous
counts afterwards (torch's only if it changed them: a caller that sets torch's count to the backend's
pays nothing). Importing numba is deferred to the
first CPU-kernel call, so the GPU backends never need it.

Threading layer: unless `NUMBA_THREADING_LAYER` says otherwise, numba's `workqueue` pool is used.
Its default here, `omp`, loads the system libgomp beside the libgomp bundled with torch, and the two
OpenMP pools spin-wait against each other between a network's alternating torch ops and kernels,
which slows a whole forward several times over. `workqueue` does not support parallel launches from
several Python threads at once, so call a CPU network from one thread at a time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch


def _numba() -> ModuleType:
    """numba, with the threading layer chosen (before its pool starts) as the module docstring says."""
    try:
        import numba
    except ImportError as error:
        raise ImportError(
            "the sparse CPU backend compiles its loops with numba, which is not installed: pip install numba"
        ) from error
    config: Any = numba.config
    if "NUMBA_THREADING_LAYER" not in os.environ and config.THREADING_LAYER == "default":
        config.THREADING_LAYER = "workqueue"
    return numba


def kernels() -> ModuleType:
    """The compiled CPU kernels (imports numba on first use)."""
    _numba()
    from tendril.sparse.ops import cpu_kernels

    return cpu_kernels


@contextlib.contextmanager
def kernel_threads(threads: int) -> Iterator[int]:
    """Let the compiled kernels use `threads` threads (at most the pool size); yields the count used."""
    numba = _numba()
    if threads < 1:
        raise ValueError(f"threads={threads}: expected at least 1")
    previous, previous_torch = numba.get_num_threads(), torch.get_num_threads()
    used = min(threads, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(used)
    if previous_torch != threads:
        torch.set_num_threads(threads)
    try:
        yield used
    finally:
        numba.set_num_threads(previous)
        if previous_torch != threads:
            torch.set_num_threads(previous_torch)
