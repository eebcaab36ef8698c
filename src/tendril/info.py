"""`tendril info`: versions, the GPU and driver, and which CUDA features tendril can use here."""

from __future__ import annotations

import importlib.metadata
import platform
from dataclasses import dataclass

import tendril
from tendril.cuda import runtime


@dataclass(frozen=True)
class EnvironmentInfo:
    versions: dict[str, str]
    gpu: str
    driver: str
    conditional_nodes: runtime.Support

    def rows(self) -> list[tuple[str, str]]:
        cond = "yes" if self.conditional_nodes.available else "no"
        return [
            *self.versions.items(),
            ("GPU", self.gpu),
            ("NVIDIA driver (CUDA version)", self.driver),
            ("CUDA conditional graph nodes", f"{cond} ({self.conditional_nodes.reason})"),
        ]


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def gpu_name() -> str:
    import torch

    if not torch.cuda.is_available():
        return "none (torch.cuda.is_available() is False)"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", ".join(names)


def collect() -> EnvironmentInfo:
    import torch

    versions = {
        "tendril": tendril.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch CUDA": str(torch.version.cuda),
        **{name: _version(name) for name in ("triton", "transformers", "cuda-bindings", "numpy")},
    }
    return EnvironmentInfo(versions, gpu_name(), runtime.driver_version_text(), runtime.conditional_nodes())
