"""Data-dependent control flow that stays on the device: `cond` and `while_loop` (see `loops` for the semantics).

Layout: `loops.py` (the API and how each call is lowered: eagerly, to a CUDA conditional node, or predicated),
`capture.py` (splicing conditional nodes into a running stream capture), `checks.py` (argument checks),
`stats.py` (calls per lowering, bound flags of predicated loops).
"""

from __future__ import annotations

from tendril.graphs.control.capture import HostSyncInGraphError, body_pool_count
from tendril.graphs.control.loops import Lowering, cond, while_loop
from tendril.graphs.control.stats import (
    ControlFlowStats,
    LoopBoundCheck,
    LoopBoundExceeded,
    check_loop_bounds,
    clear_loop_bound_checks,
    control_flow_stats,
    reset_control_flow_stats,
)

__all__ = [
    "ControlFlowStats",
    "HostSyncInGraphError",
    "LoopBoundCheck",
    "LoopBoundExceeded",
    "Lowering",
    "body_pool_count",
    "check_loop_bounds",
    "clear_loop_bound_checks",
    "cond",
    "control_flow_stats",
    "reset_control_flow_stats",
    "while_loop",
]
