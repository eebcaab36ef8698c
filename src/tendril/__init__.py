"""tendril: fast inference of irregular neural networks on NVIDIA GPUs.

Two halves: graphed execution of dynamic DNNs (shape-keyed CUDA graphs sharing one memory pool,
zero-copy inputs, device-side control flow) and sparse CNN inference (compressed weights and
activations, sparse x sparse convolution).

Importing tendril is cheap and never initialises CUDA: the public names below are resolved lazily,
on first use, from the module that implements them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "Config": "tendril.config",
    "settings": "tendril.config",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tendril' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
