"""Capture and replay of one CUDA graph: warm-up, capture into a memory pool, timed instantiation.

The inputs given to `capture` become the graph's placeholders: replaying reads whatever they hold
then, and overwrites the returned outputs in place.

Capture is split from instantiation (`CUDAGraph(keep_graph=True)`) so the device memory the driver
takes for the executable graph can be measured on its own, around `instantiate()`. Capture begins
and ends on the given stream directly rather than through `torch.cuda.graph`, whose entry
synchronises the device and empties the allocator's cache on every capture (costly when capturing
hundreds of shapes). Any work the function puts on the capturing stream is recorded, including
nodes added by other tendril modules (conditional nodes, child graphs), not only kernels.

Failing cleanly. While capturing, PyTorch's sync debug mode is set to "error", so a host
synchronisation (`.item()`, `.cpu()`, data-dependent shapes) raises at the offending call *before*
it reaches CUDA: the capture is still valid, ends normally and is discarded, which returns its pool
and leaves the random-number generator consistent. A capture CUDA itself invalidated cannot end
normally; PyTorch then leaves the default CUDA generator in capture mode and the pool taking the
allocations, so `capture` restores the one and releases the other. PyTorch's pinned-host allocator keeps
routing to that pool too, and nothing public ends that: such a pool is never captured into again
(`accepts_captures`), and callers sharing a pool take a fresh handle.

Garbage collection is paused while recording. A collection during a capture may destroy an unreachable
graph executable of some earlier `CUDAGraph` (`cudaGraphExecDestroy`), which CUDA forbids while a stream is
capturing: the capture would be invalidated. Garbage made before or during the capture is collected
after it, at the next automatic collection.

Host-to-device copies. Some model code copies a freshly made CPU tensor to the GPU on every call
(e.g. `torch.tensor(min_value).to(device)`); a copy from pageable memory cannot be captured. With
`pin_host_copies=True`, such copies are staged through pinned host buffers kept with the graph
(their values, fixed at capture, are what every replay copies), and the capture runs in "relaxed"
mode so pinning may allocate.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from tendril.graphs.memory import device_free_bytes, pool_reserved_bytes

GRAPH_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
"""Attention kernels graphs are captured with: cuDNN attention is left out because it builds a plan on the
host for every new shape, which would dominate the capture of shape-keyed graphs; flash and memory-efficient
attention need no per-shape host setup. Pass `sdpa_backends=None` to keep PyTorch's choice (what a compiled graphed
callable's default backend does: `tendril.graphed`)."""

HOST_COPY_ERROR = "Cannot copy between CPU and CUDA tensors during CUDA graph capture"
"""PyTorch's message for a pageable host-to-device copy while capturing (retry with `pin_host_copies`)."""


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    outputs: Any
    """What the captured function returned; its tensors live in the graph's pool."""
    capture_ms: float = 0.0
    """Host time for warm-up, capture and instantiation."""
    pool_growth_bytes: int = 0
    """Bytes the allocator reserved while capturing (the pool's growth for this graph)."""
    driver_bytes: int = 0
    """Device memory the driver allocated while instantiating the executable graph."""
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Host time of each phase: warmup, record, instantiate."""
    host_buffers: list[torch.Tensor] = field(default_factory=list)
    """Pinned host tensors the graph copies from at every replay (kept alive with it)."""

    def replay(self) -> Any:
        self.graph.replay()
        return self.outputs


_capture_streams = threading.local()
_abandoned_pools: set[Any] = set()
"""Pools a capture CUDA invalidated was recording to: beginning another capture into one fails ("already recording
to mempool_id") because the pinned-host allocator's routing to it was never ended."""


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (False where there is no CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def accepts_captures(pool: Any) -> bool:
    """Whether a capture may begin into `pool` (False once a capture into it was invalidated by CUDA)."""
    return pool not in _abandoned_pools


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's side stream for warm-up and capture on `device`, shared by every capture it makes.

    One stream, not one per callable: PyTorch keeps a cuBLAS workspace for each stream a matrix product ran on
    and frees none of them, so a stream per graphed callable would leave a workspace behind each. Per thread,
    so that threads capturing at once never share a capturing stream."""
    streams: dict[torch.device, torch.cuda.Stream] = _capture_streams.__dict__.setdefault("by_device", {})
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
    return streams[device]


def capture(
    fn: Callable[..., Any],
    *args: Any,
    pool: Any = None,
    warmup: int = 2,
    stream: torch.cuda.Stream | None = None,
    pin_host_copies: bool = False,
    sdpa_backends: Sequence[SDPBackend] | None = None,
    instantiate: bool = True,
    **kwargs: Any,
) -> CapturedGraph:
    """Run `fn(*args, **kwargs)` `warmup` times, then capture it as a CUDA graph and instantiate it.

    `pool` is a `torch.cuda.graph_pool_handle()` to share with other graphs (None: a private pool).
    Warm-up and capture run on `stream` (default: `capture_stream()`), which first waits for the
    current stream; the current stream then waits for the capture. A function that fails while
    capturing ends the capture and re-raises; its tensors return to the pool when the exception is
    dropped. `sdpa_backends` restricts `scaled_dot_product_attention` during warm-up and capture
    (see `GRAPH_SDPA_BACKENDS`); None keeps PyTorch's choice. `instantiate=False` leaves the captured
    graph uninstantiated (`graph.raw_cuda_graph()`) for the caller to make executables from; `driver_bytes`
    is then 0.
    """
    if pool is not None and not accepts_captures(pool):
        raise ValueError(f"pool {pool} was abandoned by a capture CUDA invalidated: capture into a fresh one")
    device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    stream = capture_stream(device) if stream is None else stream
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    stager = _PinHostCopies() if pin_host_copies else None
    attention = attention_restricted(sdpa_backends)
    with torch.cuda.stream(stream), attention:
        for _ in range(warmup):
            fn(*args, **kwargs)
        warmed = time.perf_counter()
        reserved_before = pool_reserved_bytes(device)
        generator = torch.cuda.default_generators[device.index]
        saved_generator = generator.clone_state()
        mode = "relaxed" if pin_host_copies else "thread_local"
        pool = torch.cuda.graph_pool_handle() if pool is None else pool  # named, so a failed capture can release it
        try:
            graph.capture_begin(pool=pool, capture_error_mode=mode)
        except BaseException:
            generator.graphsafe_set_state(saved_generator)
            raise
        with garbage_collection_paused():
            try:
                with _sync_errors(), stager if stager is not None else contextlib.nullcontext():
                    outputs = fn(*args, **kwargs)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the function's error is the one worth reporting
                    _end_capture(graph, generator, saved_generator, device, pool)
                raise
            _end_capture(graph, generator, saved_generator, device, pool)
    current.wait_stream(stream)
    recorded = time.perf_counter()
    pool_growth = pool_reserved_bytes(device) - reserved_before
    driver = 0
    if instantiate:
        free_before = device_free_bytes(device)
        graph.instantiate()
        driver = free_before - device_free_bytes(device)
    done = time.perf_counter()
    phases = {
        "warmup": (warmed - start) * 1e3,
        "record": (recorded - warmed) * 1e3,
        "instantiate": (done - recorded) * 1e3,
    }
    buffers = stager.buffers if stager is not None else []
    return CapturedGraph(graph, outputs, (done - start) * 1e3, pool_growth, max(driver, 0), phases, buffers)


def attention_restricted(backends: Sequence[SDPBackend] | None) -> contextlib.AbstractContextManager[Any]:
    """`scaled_dot_product_attention` restricted to `backends` inside the block (None: PyTorch's choice)."""
    return sdpa_kernel(list(backends)) if backends is not None else contextlib.nullcontext()


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside the block (see the module docstring); restores the previous state."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _sync_errors() -> Iterator[None]:
    """Make host synchronisations raise before they reach CUDA (and invalidate the capture)."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def _end_capture(
    graph: torch.cuda.CUDAGraph, generator: torch.Generator, saved: torch.Generator, device: torch.device, pool: Any
) -> None:
    """End the capture. If CUDA invalidated it (a call the function made, or another thread's), `capture_end` fails
    at `cudaStreamEndCapture`, before PyTorch takes the default generator out of capture mode and stops routing
    allocations to the pool: the generator gets its saved state back and the pool is released here, and marked
    abandoned (see `accepts_captures`); then the error is raised."""
    try:
        graph.capture_end()
    except RuntimeError:
        _abandoned_pools.add(pool)
        try:
            _release_pool(device, pool)
        finally:
            generator.graphsafe_set_state(saved)
        raise


def _release_pool(device: torch.device, pool: Any) -> None:
    """Undo what `capture_begin` did to the allocator when `capture_end` failed: stop routing allocations to
    `pool` (unless PyTorch got that far) and drop the capture's reference to it, which a graph whose capture
    never ended does not drop when it is destroyed. The pool's blocks return once their tensors are freed."""
    try:
        torch._C._cuda_endAllocateToPool(device.index, pool)
    except RuntimeError as error:
        if "not currently recording" not in str(error):
            raise
    torch._C._cuda_releasePool(device.index, pool)


class _PinHostCopies(TorchFunctionMode):
    """Stage host-to-device copies made from Python (`torch.tensor(..., device=)`, `.to()`, `.cuda()`,
    `.copy_()`) through pinned buffers, which a graph can copy from on every replay."""

    def __init__(self) -> None:
        super().__init__()
        self.buffers: list[torch.Tensor] = []

    def _pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        pinned = tensor.pin_memory()
        self.buffers.append(pinned)
        return pinned

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            device = kwargs.pop("device")
            return self._pinned(func(*args, **kwargs)).to(device, non_blocking=True)
        if _moves_host_to_cuda(func, args, kwargs):
            kwargs["non_blocking"] = True
            return func(self._pinned(args[0]), *args[1:], **kwargs)
        if func is torch.Tensor.copy_ and len(args) >= 2 and _is_host(args[1]) and _is_cuda(args[0]):
            return func(args[0], self._pinned(args[1]), True)
        return func(*args, **kwargs)


def _moves_host_to_cuda(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether `func(*args, **kwargs)` is `.to()`/`.cuda()` of a pageable host tensor onto a GPU."""
    if func not in (torch.Tensor.to, torch.Tensor.cuda) or not args or not _is_host(args[0]) or len(args) >= 4:
        return False
    return func is torch.Tensor.cuda or any(_is_cuda(a) for a in (*args[1:], kwargs.get("device")))


def _is_cuda(target: Any) -> bool:
    if isinstance(target, torch.Tensor):
        return target.is_cuda
    if isinstance(target, (str, torch.device)):
        return torch.device(target).type == "cuda"
    return isinstance(target, int) and not isinstance(target, bool)


def _is_host(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and not tensor.is_pinned()
