"""tendril: fast inference of irregular neural networks on NVIDIA GPUs.

Two halves: graphed execution of dynamic DNNs (shape-keyed CUDA graphs sharing one memory pool,
device-side control flow, whole decode loops in one launch) and sparse CNN inference (compressed
weights and activations, sparse x sparse convolution).

Importing tendril is cheap and never initialises CUDA: the public names below are resolved lazily,
on first use, from the module that implements them.
"""

from __future__ import annotations

from tendril._lazy import lazy_attributes

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "Config": "tendril.config",
    "settings": "tendril.config",
    "graphed": "tendril.graphs.callable",
    "GraphedCallable": "tendril.graphs.callable",
    "GraphFallbackWarning": "tendril.graphs.admission",
    "ModuleChangedWarning": "tendril.graphs.module_state",
    "GraphOptions": "tendril.graphs.options",
    "GraphMemoryPolicy": "tendril.graphs.options",
    "sequence_buckets": "tendril.graphs.buckets",
    "pow2_sizes": "tendril.graphs.buckets",
    "Buckets": "tendril.graphs.buckets",
    "Pad": "tendril.graphs.buckets",
    "StaleOutputError": "tendril.graphs.outputs",
    "cond": "tendril.graphs.control",
    "while_loop": "tendril.graphs.control",
    "check_loop_bounds": "tendril.graphs.control",
    "LoopBoundExceeded": "tendril.graphs.control",
    "HostSyncInGraphError": "tendril.graphs.control",
    "find_host_syncs": "tendril.graphs.syncs",
    "graphed_step": "tendril.graphs.training.step",
    "GraphedStep": "tendril.graphs.training.step",
    "DeviceGradScaler": "tendril.graphs.training.scaler",
    "generate": "tendril.generation",
    "sparse": "tendril.sparse",
}

__all__ = ["__version__", *_LAZY]

__getattr__ = lazy_attributes(__name__, _LAZY, globals())


def __dir__() -> list[str]:
    return sorted(__all__)
