"""Driver and runtime queries through cuda-python, safe to call on machines without a GPU.

`check` turns a cuda-python result tuple into values or a `CudaError` naming the call. Queries that
only describe the machine (`driver_version`, `conditional_nodes`) never raise: on a machine without
a driver they report what is missing instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONDITIONAL_NODES_MIN_DRIVER = 12040
"""CUDA conditional graph nodes (IF, WHILE, and from 12.8 IF/ELSE and SWITCH) need a 12.4 driver."""


class CudaError(RuntimeError):
    """A CUDA runtime, driver or NVRTC call returned an error."""


def check(result: Any, call: str) -> Any:
    """Unpack a cuda-python `(err, *values)` result; raise `CudaError` naming `call` on failure."""
    if not isinstance(result, tuple):
        result = (result,)
    err, *values = result
    if int(err) != 0:
        name = getattr(err, "name", str(err))
        raise CudaError(f"{call} failed: {name} ({int(err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


@dataclass(frozen=True)
class Support:
    """Whether a CUDA feature is usable here, and if not, why."""

    available: bool
    reason: str


def driver_version() -> int:
    """The CUDA version the installed driver supports (e.g. 13000), or 0 where there is no driver."""
    from cuda.bindings import runtime

    err, version = runtime.cudaDriverGetVersion()
    return int(version) if int(err) == 0 else 0


def runtime_version() -> int:
    """The CUDA runtime version the cuda-python bindings were built against (e.g. 13000)."""
    from cuda.bindings import runtime

    return int(check(runtime.cudaRuntimeGetVersion(), "cudaRuntimeGetVersion"))


def driver_version_text() -> str:
    version = driver_version()
    return _version_text(version) if version else "no NVIDIA driver"


def conditional_nodes() -> Support:
    """Whether CUDA conditional graph nodes can be built here (driver >= 12.4 and bindings that have them)."""
    try:
        from cuda.bindings import runtime
    except ImportError as exc:  # cuda-bindings is a dependency, but say so plainly if it is broken
        return Support(False, f"cuda-python bindings do not import: {exc}")
    if not hasattr(runtime, "cudaGraphConditionalHandleCreate"):
        return Support(False, "the installed cuda-python bindings lack cudaGraphConditionalHandleCreate")
    version = driver_version()
    if version == 0:
        return Support(False, "no NVIDIA driver")
    if version < CONDITIONAL_NODES_MIN_DRIVER:
        return Support(
            False,
            f"driver supports CUDA {_version_text(version)}; conditional nodes need "
            f"{_version_text(CONDITIONAL_NODES_MIN_DRIVER)}",
        )
    return Support(True, f"driver supports CUDA {_version_text(version)}")
