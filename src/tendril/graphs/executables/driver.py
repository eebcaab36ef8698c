"""What the executable cache needs from CUDA (`ExecutableDriver`) and from the keys of its graphs (`PredictNext`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any, Protocol

from tendril.cuda.graph_exec import UpdateOutcome

PredictNext = Callable[[Hashable, Hashable, Hashable], Hashable | None]
"""Given the keys of the last three calls (oldest first), the key the next call is expected to have, or None."""


class ExecutableDriver(Protocol):
    """The CUDA side of the cache (`tendril.graphs.executables.cuda.CudaExecutables`; a fake in tests).

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
