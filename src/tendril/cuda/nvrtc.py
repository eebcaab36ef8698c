"""CUDA C++ compiled at run time with NVRTC, cached, and launched on torch's current stream.

`compile_kernel(source, name)` returns a `Kernel`. Compiled code (a CUBIN for the current device's
architecture) is cached in memory per (source, name, options, compute capability) and, when the
directory is writable, on disk under `settings.cache_dir / "nvrtc"`, keyed by a hash that also covers
the NVRTC version. The CUBIN is loaded as a context-independent CUDA library (`cuLibraryLoadData`).

`Kernel.launch` enqueues on torch's current CUDA stream (or a given one) with `cuLaunchKernel`, so a
launch made while torch captures a CUDA graph becomes a kernel node of that graph. Arguments are
torch tensors (passed as device pointers) or ctypes scalars (`ctypes.c_int32(n)`, `c_int64`,
`c_float`, ...): the C parameter's type decides the width, so bare Python numbers are refused.

Loading a module is not a capturable operation; it runs with this thread's capture mode relaxed, so
a kernel first used inside a capture still loads.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tendril.cuda.runtime import CudaError, check

KernelArg = torch.Tensor | ctypes._SimpleCData
Dim = int | tuple[int, ...]

_HEADER_NOT_FOUND = "open source file"  # NVRTC: "could not open source file" / "cannot open ..."


class CompileError(RuntimeError):
    """NVRTC rejected a kernel's source; the message carries NVRTC's log."""


@dataclass(frozen=True)
class CacheStats:
    memory_hits: int
    disk_hits: int
    compiles: int
    disk_write_failures: int


@dataclass
class _Cache:
    kernels: dict[tuple[str, str, tuple[str, ...], tuple[int, int]], Kernel] = field(default_factory=dict)
    memory_hits: int = 0
    disk_hits: int = 0
    compiles: int = 0
    disk_write_failures: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


_CACHE = _Cache()


def cache_stats() -> CacheStats:
    """How `compile_kernel` calls were served so far in this process."""
    return CacheStats(_CACHE.memory_hits, _CACHE.disk_hits, _CACHE.compiles, _CACHE.disk_write_failures)


def nvrtc_version() -> tuple[int, int]:
    from cuda.bindings import nvrtc

    major, minor = check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return int(major), int(minor)


def compile_kernel(source: str, name: str, *, options: Sequence[str] = ()) -> Kernel:
    """Compile `name` (an `extern "C" __global__` function in `source`) for the current CUDA device.

    `options` are NVRTC options (e.g. `-default-device`, `-DBLOCK=128`); the target architecture is
    added unless an `-arch`/`--gpu-architecture` option is given. Raises `CompileError` with NVRTC's log.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("compile_kernel needs a CUDA device; none is available here")
    capability = torch.cuda.get_device_capability()
    key = (source, name, tuple(options), capability)
    with _CACHE.lock:
        kernel = _CACHE.kernels.get(key)
        if kernel is not None:
            _CACHE.memory_hits += 1
            return kernel
        cubin = _cubin(source, name, tuple(options), capability)
        kernel = Kernel(name, cubin)
        _CACHE.kernels[key] = kernel
        return kernel


def _cubin(source: str, name: str, options: tuple[str, ...], capability: tuple[int, int]) -> bytes:
    from tendril.config import settings

    arch_given = any(o.startswith(("-arch", "--gpu-architecture")) for o in options)
    full_options = options if arch_given else (*options, f"--gpu-architecture=sm_{capability[0]}{capability[1]}")
    digest = hashlib.sha256(repr((source, name, full_options, nvrtc_version())).encode()).hexdigest()[:32]
    path = Path(settings.cache_dir) / "nvrtc" / f"{name}-{digest}.cubin"
    if path.is_file():
        _CACHE.disk_hits += 1
        return path.read_bytes()
    cubin = _compile(source, name, full_options)
    _CACHE.compiles += 1
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError:
        _CACHE.disk_write_failures += 1  # the in-memory cache still serves this process
    return cubin


def _compile(source: str, name: str, options: tuple[str, ...]) -> bytes:
    try:
        return _nvrtc_compile(source, name, options)
    except CompileError as exc:
        include = _toolkit_include_dir()
        if _HEADER_NOT_FOUND not in str(exc) or include is None:
            raise
        return _nvrtc_compile(source, name, (*options, f"--include-path={include}"))


def _toolkit_include_dir() -> str | None:
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for root in roots:
        if root and (Path(root) / "include" / "cuda_runtime.h").is_file():
            return str(Path(root) / "include")
    return None


def _nvrtc_compile(source: str, name: str, options: tuple[str, ...]) -> bytes:
    from cuda.bindings import nvrtc

    program = check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
        if int(err) != 0:
            raise CompileError(
                f"NVRTC could not compile kernel {name!r} (options {list(options)}):\n{_program_log(program)}"
            )
        size = check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
        cubin = b" " * size
        check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def _program_log(program: Any) -> str:
    from cuda.bindings import nvrtc

    size = check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
    log = b" " * size
    check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
    return log.decode(errors="replace").rstrip("\x00").strip()


@contextlib.contextmanager
def relaxed_capture_mode() -> Iterator[None]:
    """Allow this thread's non-capturable CUDA calls (module loading) while a stream capture is running."""
    from cuda.bindings import runtime

    previous = check(
        runtime.cudaThreadExchangeStreamCaptureMode(runtime.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed),
        "cudaThreadExchangeStreamCaptureMode",
    )
    try:
        yield
    finally:
        check(runtime.cudaThreadExchangeStreamCaptureMode(previous), "cudaThreadExchangeStreamCaptureMode")


def _ensure_context(device: int) -> None:
    """Make `device`'s primary context current on this thread (torch's runtime calls share it)."""
    from cuda.bindings import driver, runtime

    if int(check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")) == 0:
        check(runtime.cudaSetDevice(device), "cudaSetDevice")


class Kernel:
    """One compiled kernel: a loaded CUDA library and the kernel handle in it."""

    def __init__(self, name: str, cubin: bytes) -> None:
        from cuda.bindings import driver

        self.name = name
        self.cubin = cubin
        _ensure_context(torch.cuda.current_device())
        with relaxed_capture_mode():
            self._library = check(driver.cuLibraryLoadData(cubin, None, None, 0, None, None, 0), "cuLibraryLoadData")
            self._kernel = check(driver.cuLibraryGetKernel(self._library, name.encode()), "cuLibraryGetKernel")
        self._loaded_on: set[int] = set()

    def _load_on(self, device: int) -> None:
        """Load the module into `device`'s context now, outside any capture restrictions."""
        from cuda.bindings import driver

        if device in self._loaded_on:
            return
        with relaxed_capture_mode():
            check(driver.cuKernelGetFunction(self._kernel), "cuKernelGetFunction")
        self._loaded_on.add(device)

    def launch(
        self,
        grid: Dim,
        block: Dim,
        args: Sequence[KernelArg],
        *,
        shared_mem: int = 0,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Enqueue the kernel on `stream` (default: torch's current stream); capturable, never syncs."""
        from cuda.bindings import driver

        device = torch.cuda.current_device()
        _ensure_context(device)
        self._load_on(device)
        stream = torch.cuda.current_stream(device) if stream is None else stream
        values = [self._c_value(i, a, device) for i, a in enumerate(args)]
        pointers = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
        gx, gy, gz = _dim3(grid, "grid")
        bx, by, bz = _dim3(block, "block")
        result = driver.cuLaunchKernel(
            self._kernel, gx, gy, gz, bx, by, bz, shared_mem, stream.cuda_stream, ctypes.addressof(pointers), 0
        )
        try:
            check(result, f"cuLaunchKernel({self.name})")
        except CudaError as exc:
            raise CudaError(f"{exc} with grid {grid}, block {block}, shared_mem {shared_mem}") from None

    def _c_value(self, index: int, arg: object, device: int) -> ctypes._SimpleCData:
        if isinstance(arg, torch.Tensor):
            if arg.device.type != "cuda" or arg.device.index != device:
                raise ValueError(
                    f"kernel {self.name!r} argument {index}: expected a tensor on cuda:{device}, "
                    f"got one on {arg.device}"
                )
            return ctypes.c_void_p(arg.data_ptr())
        if isinstance(arg, ctypes._SimpleCData):
            return arg
        raise TypeError(
            f"kernel {self.name!r} argument {index}: expected a torch tensor or a ctypes scalar "
            f"(e.g. ctypes.c_int32(n), ctypes.c_float(x)), got {type(arg).__name__}; the width must match the C type"
        )


def _dim3(dim: Dim, what: str) -> tuple[int, int, int]:
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if not 1 <= len(dims) <= 3 or any(d < 1 for d in dims):
        raise ValueError(f"{what} must be 1 to 3 positive sizes, got {dim}")
    padded = (*dims, 1, 1)
    return padded[0], padded[1], padded[2]
