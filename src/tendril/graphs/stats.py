"""What a graphed callable did: captures, replays, eager fallbacks with their reasons, memory per graph.

`GraphedCallable.stats` is a live `GraphStats`; tests assert on its counters and users read it (or
print `stats.table()`) to see why a call did not run as a graph.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tendril.graphs.key import GraphKey

if TYPE_CHECKING:
    from tendril.graphs.compiled import CompileStats


class Fallback(enum.Enum):
    """Why a call ran eagerly instead of as a graph."""

    NO_CUDA = "no CUDA device: every call runs eagerly"
    GRAPHS_DISABLED = "graphs disabled by TENDRIL_NO_GRAPHS (tendril.settings.disable_graphs)"
    UNKEYABLE = "an argument cannot be part of a graph key (not hashable)"
    CPU_TENSOR = "a tensor argument is not on a CUDA device"
    MIXED_DEVICES = "tensor arguments on several devices"
    REQUIRES_GRAD = "grad mode is on and an argument or a parameter of the callable requires grad (graphs skip it)"
    LIMIT = "new key past max_graphs"
    HOST_SYNC = (
        "the function synchronises with the host while capturing (.item(), .cpu(), data-dependent shapes; "
        "tendril.find_host_syncs(fn, *args) names each one and its line)"
    )
    MUTATES_INPUTS = "the function writes into its tensor arguments"
    CAPTURE_ERROR = "capturing raised an error (an operation that cannot be captured)"
    PADDED_OUTPUTS = "a bucket's outputs cannot be cut back to the call's length (they do not follow it one to one)"
    COMPILING = "a new key while the function compiles in the background (tendril.graphs.compiled)"


class Misprediction(enum.Enum):
    """Why an argument was copied into its placeholder although zero-copy inputs were on (`tendril.graphs.alias`)."""

    NO_OUT_FORM = "its producer has no out= form (a view, a factory, a multi-output op), so it cannot be redirected"
    SIGNATURE = "the producer ran with other argument dtypes, devices or constants than when it was learned"
    REFERENCED = "the placeholder slot still holds a tensor the program references"
    READS_PLACEHOLDER = "the producer reads the buffer it would write"
    TOO_LARGE = "the output did not fit the placeholder buffer"
    NOT_PASSED = "a redirected output was not passed where predicted (another producer, or not passed at all)"
    MOVED = "the call's graph reads another placeholder buffer or layout than the redirect wrote"
    CARRY_COPY = "a carried output's producer could not write into the next placeholder; copied inside the graph"


@dataclass
class GraphMemory:
    """Memory and switching of one graph's executable (see `tendril.graphs.executables`).

    Under the dedicated strategy each graph keeps the executable made at capture; under a budget the
    captured graph stays on the host and an executable is instantiated, updated or evicted on demand."""

    strategy: str = "dedicated"
    family: str | None = None
    """Digest of the graph's topology; graphs of one family can share an executable through updates."""
    nodes: int | None = None
    segments: int = 1
    """Executables the graph runs as, one per segment of consecutive nodes (`tendril.graphs.executables.cuda`)."""
    host_bytes: int | None = None
    """Host memory taken while capturing (process RSS growth: the kept CUDA graph and its segments, bounded from
    above)."""
    executable_bytes: int = 0
    """Driver memory charged to the executable holding this graph now (0 while it has none)."""
    instantiations: int = 0
    """Instantiations of this graph's executables, on the call path and in the background (then also `prefetches`)."""
    prefetches: int = 0
    """Instantiations and updates started in the background ahead of a call predicted to need
    this graph."""
    prefetch_hits: int = 0
    """Calls that found this graph's executable prefetched (ready, or still being made: then also a wait)."""
    prefetch_waits: int = 0
    """Calls that waited on the host for this graph's prefetched executable to be ready."""
    prefetch_wasted: int = 0
    """Prefetched executables of this graph evicted before any call used them."""
    updates: int = 0
    """Switches of another graph's executable to this graph by `cudaGraphExecUpdate` that CUDA accepted, on the call
    path and in the background (then also `prefetches`; counted once a call, eviction or close took its outcome)."""
    update_failures: int = 0
    """Updates to this graph CUDA refused (the graph then moves into a family of its own)."""
    evictions: int = 0
    switch_ms: float = 0.0
    """Host time the call path spent giving this graph an executable (instantiations, updates, evictions, starting
    a prefetch and waiting for one, after capture; a switch at launch counts the whole launch, its segments' updates
    interleaved with their launches); the background thread's time is not counted."""


@dataclass
class GraphRecord:
    """One captured graph."""

    key: GraphKey
    capture_ms: float
    """Host time to warm up, capture and instantiate the graph."""
    pool_growth_bytes: int
    """Bytes the shared pool grew by to capture this graph (0 when it reused memory already in the pool)."""
    driver_bytes: int | None
    """Device memory the driver allocated to instantiate the graph (cudaMemGetInfo around instantiation);
    None where not measured (the null backend)."""
    replays: int = 0
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Host time of each capture phase: warmup, record, instantiate."""
    memory: GraphMemory = field(default_factory=GraphMemory)


@dataclass
class GraphStats:
    """Counters of one graphed callable."""

    calls: int = 0
    replays: int = 0
    eager_calls: int = 0
    padded_calls: int = 0
    """Calls padded up to a bucket."""
    input_copies: int = 0
    """Tensor arguments copied into placeholders (arguments already in their placeholder are not copied)."""
    fallbacks: Counter[Fallback] = field(default_factory=Counter)
    fallback_details: dict[Fallback, str] = field(default_factory=dict)
    """The first detailed message seen for each reason (the exception text for capture errors)."""
    graphs: dict[GraphKey, GraphRecord] = field(default_factory=dict)
    failed_keys: dict[GraphKey, Fallback] = field(default_factory=dict)
    """Keys whose capture failed; they run eagerly from then on without retrying."""
    pool_bytes: int = 0
    """Bytes reserved by the callable's shared graph pool(s)."""
    placeholder_bytes: int = 0
    """Bytes of the placeholder buffers shared by all graphs."""
    input_bytes_copied: int = 0
    """Bytes copied into placeholders before replays (and carried outputs copied inside graphs)."""
    input_copies_avoided: int = 0
    """Tensor arguments already in their placeholder (a redirected producer, carried state, `inputs_for`)."""
    input_bytes_avoided: int = 0
    redirects: int = 0
    """Producers that wrote straight into a placeholder under `zero_copy()`."""
    mispredictions: Counter[Misprediction] = field(default_factory=Counter)
    misprediction_details: dict[Misprediction, str] = field(default_factory=dict)
    """The first detailed message seen for each misprediction reason."""
    module_changes: int = 0
    """Times the callable's modules were found changed with graphs captured (a tensor replaced or moved, a mode
    flipped: `module_state`): each time
    every graph was dropped, for later calls to capture again."""
    module_change_detail: str = ""
    """What the last of those changes was."""
    compile: CompileStats | None = None
    """With `tendril.graphed(fn, compile=...)`: compiles, the switch to compiled graphs, a failure's reason."""

    @property
    def captures(self) -> int:
        return len(self.graphs)

    @property
    def driver_bytes(self) -> int:
        return sum(record.driver_bytes or 0 for record in self.graphs.values())

    @property
    def executable_bytes(self) -> int:
        """Driver memory charged to the executables alive now (under a graph-memory budget)."""
        return sum(record.memory.executable_bytes for record in self.graphs.values())

    @property
    def switch_ms(self) -> float:
        """Host time spent instantiating and updating executables after capture."""
        return sum(record.memory.switch_ms for record in self.graphs.values())

    @property
    def bytes_copied_per_call(self) -> float:
        """Mean bytes copied into placeholders per replay."""
        return self.input_bytes_copied / self.replays if self.replays else 0.0

    def record_misprediction(self, reason: Misprediction, detail: str) -> None:
        self.mispredictions[reason] += 1
        self.misprediction_details.setdefault(reason, detail)

    def record_fallback(self, reason: Fallback, detail: str) -> None:
        """Count an eager call and why it was eager."""
        self.eager_calls += 1
        self.fallbacks[reason] += 1
        self.fallback_details.setdefault(reason, detail)

    def table(self) -> str:
        """A plain-text summary: totals, fallbacks with reasons, one line per graph."""
        mib = 1 << 20
        lines = [
            f"calls {self.calls}: {self.replays} replays, {self.eager_calls} eager, {self.captures} graphs, "
            f"pool {self.pool_bytes / mib:.1f} MiB, placeholders {self.placeholder_bytes / mib:.2f} MiB, "
            f"driver {self.driver_bytes / mib:.1f} MiB",
        ]
        if any(record.memory.strategy != "dedicated" for record in self.graphs.values()):
            lines[0] += f", executables now {self.executable_bytes / mib:.1f} MiB, switching {self.switch_ms:.1f} ms"
        for reason, detail in self.fallback_details.items():
            lines.append(f"  eager x{self.fallbacks[reason]}: {reason.value}: {detail}")
        if self.input_copies or self.input_copies_avoided:
            lines.append(
                f"  inputs: {self.input_bytes_copied / mib:.2f} MiB copied ({self.bytes_copied_per_call / 1024:.1f} KiB"
                f" per call), {self.input_copies_avoided} copies avoided ({self.input_bytes_avoided / mib:.2f} MiB), "
                f"{self.redirects} redirects"
            )
        for miss, detail in self.misprediction_details.items():
            lines.append(f"  copied x{self.mispredictions[miss]}: {miss.value}: {detail}")
        if self.module_changes:
            lines.append(f"  graphs dropped x{self.module_changes} (modules changed): {self.module_change_detail}")
        if self.compile is not None:
            lines.append(f"  {self.compile.summary()}")
        for record in self.graphs.values():
            driver = "n/a" if record.driver_bytes is None else f"{record.driver_bytes / mib:.2f} MiB"
            lines.append(
                f"  graph {record.key}: capture {record.capture_ms:.1f} ms, pool +{record.pool_growth_bytes / mib:.1f}"
                f" MiB, driver {driver}, replays {record.replays}{_switching(record.memory)}"
            )
        return "\n".join(lines)


def _switching(memory: GraphMemory) -> str:
    if memory.strategy == "dedicated":
        return ""
    return (
        f", {memory.strategy}: family {memory.family}, {memory.instantiations} instantiations, {memory.updates} "
        f"updates, {memory.evictions} evictions, switching {memory.switch_ms:.2f} ms{_prefetching(memory)}"
    )


def _prefetching(memory: GraphMemory) -> str:
    if not memory.prefetches:
        return ""
    return (
        f", {memory.prefetches} prefetched ({memory.prefetch_hits} hits, {memory.prefetch_waits} waits, "
        f"{memory.prefetch_wasted} wasted)"
    )
