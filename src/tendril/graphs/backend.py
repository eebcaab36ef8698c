"""Backends: the part of graphed execution that actually captures and replays.

`GraphedCallable` decides *which* graph serves a call (keys, buckets, limits, fallbacks); a backend
only captures one graph for given placeholders and replays it. `CudaBackend` (cuda_backend.py) does
this with CUDA graphs; `NullBackend` here simulates it on any device so the dispatch policy, limits,
fallback reasons, statistics and output lifetime rules are tested in CI without a GPU.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.utils import _pytree as pytree

from tendril.graphs.key import GraphKey
from tendril.graphs.stats import Fallback, GraphMemory


class CaptureFailed(Exception):
    """A graph could not be captured; the call runs eagerly and `reason` is recorded."""

    def __init__(self, reason: Fallback, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Captured:
    """One graph as the callable sees it."""

    replay: Callable[[], None]
    """Launch the graph: reads the placeholders, overwrites `outputs`."""
    outputs: Any
    """The function's return value; its tensors live in graph memory and are rewritten by each replay."""
    capture_ms: float
    pool_growth_bytes: int
    driver_bytes: int | None
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Host time of each capture phase (warmup, record, instantiate) where measured."""
    memory: GraphMemory | None = None
    """The graph's executable memory and switching, kept up to date by the backend (None: not tracked)."""
    before_inputs: Callable[[], None] | None = None
    """Called before a call's inputs are copied into the placeholders (e.g. to order the call's stream after
    the previous launch, which may still read them)."""


class Backend(Protocol):
    def unavailable(self) -> tuple[Fallback, str] | None:
        """Why this backend cannot capture anything here, or None."""

    def accepts(self, device: torch.device) -> bool:
        """Whether tensors on `device` can be graph inputs."""

    def capture(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: GraphKey, warmup: int
    ) -> Captured:
        """Warm up and capture `fn(*args, **kwargs)` (args hold the placeholders); raise `CaptureFailed`."""

    def pool_bytes(self) -> int:
        """Bytes the shared pool(s) reserve."""

    def forget_graphs(self) -> None:
        """The callable dropped every graph this backend captured for it: keep nothing of them (a later capture starts
        a fresh pool: the old one is freed with its last graph, and capturing into a freed pool fails)."""


_HOST_SYNC_MARKERS = (
    "operation not permitted when stream is capturing",
    "cudaErrorStreamCaptureUnsupported",
    "cudaErrorStreamCaptureInvalidated",
    "cudaErrorStreamCaptureImplicit",
    "operation failed due to a previous error during capture",
    "during CUDA graph capture",
    "stream is capturing",
    "capture was invalidated",
    "synchronizing CUDA operation",
    "HostSync",
    "Cannot copy between CPU and CUDA tensors during CUDA graph capture",
)


def classify_capture_error(error: BaseException) -> CaptureFailed:
    """Name what went wrong while capturing, a host synchronisation or another capture error, and where it was
    raised (`raised_at`)."""
    if isinstance(error, CaptureFailed):
        return error
    text = f"{type(error).__name__}: {error}".strip()
    first_line = text.splitlines()[0] if text else type(error).__name__
    where = raised_at(error)
    detail = f"{first_line} (raised at {where})" if where else first_line
    if any(marker.lower() in text.lower() for marker in _HOST_SYNC_MARKERS):
        return CaptureFailed(Fallback.HOST_SYNC, detail)
    return CaptureFailed(Fallback.CAPTURE_ERROR, detail)


def raised_at(error: BaseException, frames: int = 2) -> str | None:
    """The innermost `frames` Python frames that `error` was raised through, innermost first, as
    `file:line function` joined by " from ", each file from its package's folder on: a CUDA error raised by a
    library's helper (a synchronize) names the code that called it too. None without a traceback."""
    stack = traceback.extract_tb(error.__traceback__)[-frames:]
    return " from ".join(f"{_short(frame.filename)}:{frame.lineno} {frame.name}" for frame in reversed(stack)) or None


def _short(filename: str) -> str:
    """`filename` from its top package's folder on (after `site-packages/` or `src/`), else its last two parts."""
    for marker in ("site-packages/", "src/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return "/".join(filename.replace("\\", "/").split("/")[-2:])


class NullBackend:
    """Simulated graphs: capture runs the function once; replay reruns it and copies the results into the
    captured outputs' storage, so outputs are overwritten at every replay as graph memory is.

    `graph_device_type` is the device type it treats as capturable ("cpu" so CPU tests can graph;
    "cuda" to test the CPU-tensor fallback). `fail(key)` may return a `CaptureFailed` to simulate a
    failed capture for that key.
    """

    def __init__(
        self,
        graph_device_type: str = "cpu",
        fail: Callable[[GraphKey], CaptureFailed | None] | None = None,
    ) -> None:
        self.graph_device_type = graph_device_type
        self.fail = fail
        self.captures = 0
        self.replays = 0
        self.warmup_runs = 0
        self.forgotten = 0
        """Calls of `forget_graphs`: the times the callable dropped every graph."""

    def unavailable(self) -> tuple[Fallback, str] | None:
        return None

    def accepts(self, device: torch.device) -> bool:
        return device.type == self.graph_device_type

    def capture(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: GraphKey, warmup: int
    ) -> Captured:
        failure = self.fail(key) if self.fail is not None else None
        if failure is not None:
            raise failure
        for _ in range(warmup):
            fn(*args, **kwargs)
            self.warmup_runs += 1
        try:
            outputs = pytree.tree_map_only(torch.Tensor, torch.clone, fn(*args, **kwargs))
        except Exception as error:
            raise classify_capture_error(error) from None
        self.captures += 1
        targets = [leaf for leaf in pytree.tree_leaves(outputs) if isinstance(leaf, torch.Tensor)]

        def replay() -> None:
            self.replays += 1
            results = [leaf for leaf in pytree.tree_leaves(fn(*args, **kwargs)) if isinstance(leaf, torch.Tensor)]
            if results:
                torch._foreach_copy_(targets, results)

        return Captured(replay, outputs, 0.0, 0, None)

    def pool_bytes(self) -> int:
        return 0

    def forget_graphs(self) -> None:
        self.forgotten += 1
