"""Graphed execution of dynamic DNNs: CUDA graphs keyed by input shapes, sharing one memory pool.

Public names (listed in `_LAZY` below) resolve lazily so importing a submodule stays cheap.
"""

from __future__ import annotations

from tendril._lazy import lazy_attributes

_LAZY: dict[str, str] = {
    "graphed": "tendril.graphs.callable",
    "GraphedCallable": "tendril.graphs.callable",
    "GraphFallbackWarning": "tendril.graphs.admission",
    "ModuleChangedWarning": "tendril.graphs.module_state",
    "Call": "tendril.graphs.examples",
    "Buckets": "tendril.graphs.buckets",
    "Pad": "tendril.graphs.buckets",
    "sequence_buckets": "tendril.graphs.buckets",
    "pow2_sizes": "tendril.graphs.buckets",
    "GraphKey": "tendril.graphs.key",
    "Fallback": "tendril.graphs.stats",
    "GraphStats": "tendril.graphs.stats",
    "StaleOutputError": "tendril.graphs.outputs",
    "NullBackend": "tendril.graphs.backend",
    "find_host_syncs": "tendril.graphs.syncs",
    "CudaBackend": "tendril.graphs.cuda_backend",
    "GraphOptions": "tendril.graphs.options",
    "GraphMemoryPolicy": "tendril.graphs.options",
    "MemoryStrategy": "tendril.graphs.options",
    "CompileOptions": "tendril.graphs.options",
    "CompileMode": "tendril.graphs.options",
    "CompileStats": "tendril.graphs.compiled",
    "CompileFallbackWarning": "tendril.graphs.compiled",
    "GraphMemory": "tendril.graphs.stats",
    "Misprediction": "tendril.graphs.stats",
    "LaneKey": "tendril.graphs.zero_copy.lanes",
}

__all__ = list(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY, globals())
