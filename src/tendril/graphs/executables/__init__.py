"""Executables of many graphs under a device-memory budget.

Why: every instantiated CUDA graph holds device memory of the driver's own, on top of the memory pool all graphs of
a callable share, roughly in proportion to its nodes. A callable with one graph per sequence length spends most of
its memory there. The captured graphs (`cudaGraph_t`) live on the host, so their executables can be managed apart
from them: the CUDA backend keeps the captured graphs and this cache gives each an executable on demand.

What (strategy `update`, see `tendril.graphs.options.MemoryStrategy`; `dedicated` is torch's own replay and does
not come here):
- `policy`: the cache. A miss instantiates while the budget has room; once it is full, it switches an executable
  of the graph's topology family (graphs whose node types, launch configurations and edges match:
  `graph_exec.Topology`) by `cudaGraphExecUpdate` instead of evicting and instantiating. A family's last
  executable is evicted only once no family has one to spare.
- `prefetch`: predicts the next calls from the last three and makes their executables on a background thread.
- `accounting`: what each executable is charged against the budget (a bytes-per-node rate learnt from
  measurements).
- `entries`: the bookkeeping, each executable in an explicit `ExecutableState`.
- `cuda`: the CUDA driver side: graphs cut into segments, each segment an executable, launched as a chain; the
  background worker thread.

Invariants:
- Ordering. CUDA applies an update to later launches only and frees a destroyed executable after its running
  launch completes (`tendril.cuda.graph_exec`); the CUDA driver still waits for an executable's last launch before
  updating or destroying it. The cache never hands out an executable queued for destruction, and waits for a
  pending prefetch before launching it, so an executable is never launched after its destruction or during its
  update. A switch at launch updates each segment right before launching it, in the call's stream.
- Results are those of dedicated executables: an executable runs exactly the nodes and parameters of the graph it
  was instantiated from or updated to, and every update is checked. A refused update (CUDA sees differences the
  topology digest does not) moves the graph into a family of its own and instantiates it; a switch refused at
  launch has already run the graph (the driver instantiated the refused segments), and the executable moves into
  the new family with it. Failures are counted in the graph's `GraphMemory`.
- Budget accounting. The budget holds for the charges (`accounting`) of the live and pending executables plus
  reserved bytes (executables kept outside the cache, e.g. graphs that draw random numbers). One executable larger
  than the budget is still instantiated (a graph must run) and counted in `over_budget`.

Limits: a call that switches spends host time updating segments, and an updated executable may run slower on the
GPU than a fresh one, so short calls that switch at nearly every call are host-bound; the first calls after a jump
are not predicted; the driver never gives executable memory back to the device, so the device's footprint is the
high-water mark of the live executables (which the budget bounds) plus any brief excess while destructions are
queued; the learnt rate undercounts executables that reuse memory destroyed ones freed.
"""

from tendril.graphs.executables.accounting import PRIOR_BYTES_PER_NODE, PRIOR_NODES, Accounting
from tendril.graphs.executables.driver import ExecutableDriver, PredictNext
from tendril.graphs.executables.entries import ExecutableState
from tendril.graphs.executables.policy import ExecutableCache
from tendril.graphs.executables.prefetch import PREFETCH_AHEAD

__all__ = [
    "PREFETCH_AHEAD",
    "PRIOR_BYTES_PER_NODE",
    "PRIOR_NODES",
    "Accounting",
    "ExecutableCache",
    "ExecutableDriver",
    "ExecutableState",
    "PredictNext",
]
