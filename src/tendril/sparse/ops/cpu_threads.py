"""Thread control shared by the CPU operators.

The compiled kernels (`cpu_kernels.py`) run on numba's thread pool. `kernel_threads(n)` gives them `n` threads
(capped at the pool size, `NUMBA_NUM_THREADS`, which defaults to the number of cores) and puts torch on one
thread meanwhile, restoring both counts afterwards. Torch's own work inside the engine (MKL's sparse BLAS on one
thread, small glue ops between layers) is small; what matters is that torch's OpenMP pool stays asleep: at more
than one thread its workers spin-wait after every op, and while they spin they take the cores numba's workers
need, so a forward on `n` threads would run no faster than on one. A CPU network's forward holds
`kernel_threads` for its whole run: the calls inside it see the count it set (`held`) and enter nothing again,
and a nested `kernel_threads` of the same count changes nothing. Torch's count is process-wide, so run CPU networks
from one Python thread at a time. Importing numba is deferred to the first CPU-kernel call, so the GPU backends
never need it.

Threading layer: unless `NUMBA_THREADING_LAYER` or `NUMBA_THREADING_LAYER_PRIORITY` says otherwise, numba takes
OpenMP (`omp`) where it loads, else TBB, else its own `workqueue` pool (`threading_layer()` says which ran). A
forward starts a parallel region per kernel, several per layer: OpenMP releases its waiting workers at a barrier,
where `workqueue` wakes and waits for every worker twice through a condition variable, a cost per region that grows
with the thread count and, over a deep network's many regions, outweighs the extra threads. Numba's OpenMP layer
runs on the system's libgomp, which torch shares or bundles a copy of; either way the two do not contend, as torch
stays on one thread during a forward (above), and starting the pool, which may set a shared runtime's count, leaves
torch's as it was. GNU OpenMP is not fork-safe: a process forked after a CPU forward must not run CPU networks.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

_held = threading.local()
"""`threads`: the kernel thread count the innermost `kernel_threads` of this Python thread set (numba's count is
per thread, so this is too)."""
_kernels: ModuleType | None = None


@functools.cache
def _numba() -> ModuleType:
    """numba with its pool started, on the threading layer the module docstring says (chosen before the start)."""
    try:
        import numba
    except ImportError as error:
        raise ImportError(
            "the sparse CPU backend compiles its loops with numba, which is not installed: pip install numba"
        ) from error
    config: Any = numba.config
    chosen_by_user = {"NUMBA_THREADING_LAYER", "NUMBA_THREADING_LAYER_PRIORITY"} & os.environ.keys()
    if not chosen_by_user and config.THREADING_LAYER == "default":
        config.THREADING_LAYER_PRIORITY = ["omp", "tbb", "workqueue"]
    torch_threads = torch.get_num_threads()
    numba.get_num_threads()  # starts the pool; the OpenMP layer sets the thread count of a runtime torch may share
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)
    return numba


def threading_layer() -> str | None:
    """The threading layer numba's parallel kernels run on, once one has run (None before)."""
    numba = _numba()
    try:
        return str(numba.threading_layer())
    except ValueError:
        return None


def kernels() -> ModuleType:
    """The compiled CPU kernels (imports numba on first use). Callers look a kernel up on the module at each call,
    so that a profiler can wrap it there."""
    global _kernels
    if _kernels is None:
        _numba()
        from tendril.sparse.ops import cpu_kernels

        _kernels = cpu_kernels
    return _kernels


def usable(threads: int) -> int:
    """The count `kernel_threads(threads)` gives the kernels: `threads`, at most numba's pool size."""
    if threads < 1:
        raise ValueError(f"threads={threads}: expected at least 1")
    return min(threads, _numba().config.NUMBA_NUM_THREADS)


def held() -> int:
    """The kernel thread count a `kernel_threads` around this call set (0 outside any): a caller that finds the count
    it needs there runs its kernels directly."""
    return getattr(_held, "threads", 0)


@contextlib.contextmanager
def kernel_threads(threads: int) -> Iterator[int]:
    """Let the compiled kernels use `threads` threads (at most the pool size) and torch one; yields the count
    used. Only the counts that differ are set (and restored); inside a `kernel_threads` of the same count, none
    is."""
    used, outer = usable(threads), held()
    if outer == used:
        yield used
        return
    numba = _numba()
    previous, previous_torch = numba.get_num_threads(), torch.get_num_threads()
    if previous != used:
        numba.set_num_threads(used)
    if previous_torch != 1:
        torch.set_num_threads(1)
    _held.threads = used
    try:
        yield used
    finally:
        _held.threads = outer
        if previous != used:
            numba.set_num_threads(previous)
        if previous_torch != 1:
            torch.set_num_threads(previous_torch)
