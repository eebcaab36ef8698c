"""Calls of one graphed callable from several threads.

A callable's graphs share one set of placeholders, one memory pool, and outputs that its next call overwrites, so
two of its calls must not overlap. With `clone_outputs=True` every call returns copies of its own, so overlapping
calls take turns (a lock). Without it a caller reads outputs that any later call overwrites, so taking turns would
not make threads safe: a call that overlaps another raises instead of returning the other's results. Calls that run
eagerly before any graph is involved (no CUDA, `TENDRIL_NO_GRAPHS`, grad mode with a tensor requiring grad) share
nothing with others and never wait. The lock is re-entrant, so a call made on the same thread from within the
callable's own function passes.
"""

from __future__ import annotations

import threading
from types import TracebackType


class Turns:
    """A context for each call of the graphed callable `name` (module docstring): waits for its turn (`wait`), or
    raises `RuntimeError` when another thread's call is running; does nothing when not `active`."""

    def __init__(self, name: str, *, wait: bool, active: bool) -> None:
        self.name = name
        self.wait = wait
        self.active = active
        self._lock = threading.RLock()

    def __enter__(self) -> None:
        if self.active and not self._lock.acquire(blocking=self.wait):
            raise RuntimeError(
                f"tendril.graphed({self.name}) was called from a second thread while a call was running: its graphs "
                "share placeholders and outputs, so one call would return the other's results. Give each thread its "
                "own callable, or pass clone_outputs=True to make calls take turns."
            )

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if self.active:
            self._lock.release()
