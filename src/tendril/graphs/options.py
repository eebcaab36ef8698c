"""Options of a graphed callable: one typed object from `tendril.graphed` down to the backend.

`GraphOptions` holds what the dispatcher needs (buckets, bounds, output handling, warm-up runs);
`GraphMemoryPolicy` holds how the CUDA backend keeps the executables of the graphs (see
`tendril.graphs.executables`). Both validate at construction, so a bad value fails where it is written.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tendril.graphs.memory import parse_bytes

if TYPE_CHECKING:
    from tendril.config import Config
    from tendril.graphs.buckets import Buckets

DEFAULT_MAX_GRAPHS = 64


class MemoryStrategy(str, enum.Enum):
    """How the executables of a callable's graphs are kept.

    - `dedicated`: one executable per graph, made at capture and kept (what `torch.cuda.graph` does);
    - `update`: executables made on demand under a budget; once it is full, a miss switches an executable
      of the graph's topology family by `cudaGraphExecUpdate` (see `tendril.graphs.executables`);
    - `auto`: `dedicated` without a budget, `update` with one.
    """

    AUTO = "auto"
    DEDICATED = "dedicated"
    UPDATE = "update"


@dataclass(frozen=True)
class GraphMemoryPolicy:
    """Device memory of graph executables: a budget, how to keep executables under it, and prefetching.

    `budget`: bytes, or a string such as "256MiB" (stored as bytes); None takes the process default
    (`Config.graph_memory_budget`, from TENDRIL_GRAPH_MEMORY_BUDGET; see `with_default_budget`).
    `prefetch`: under a budget, make the executable of the call predicted next on a background thread.
    """

    budget: int | None = None
    strategy: MemoryStrategy = MemoryStrategy.AUTO
    prefetch: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", parse_bytes(self.budget))
        try:
            object.__setattr__(self, "strategy", MemoryStrategy(self.strategy))
        except ValueError:
            names = ", ".join(repr(s.value) for s in MemoryStrategy)
            raise ValueError(f"graph memory strategy {self.strategy!r}: expected one of {names}") from None
        if not isinstance(self.prefetch, bool):
            raise TypeError(f"graph memory prefetch must be True or False, got {self.prefetch!r}")
        if self.strategy is MemoryStrategy.DEDICATED and self.budget is not None:
            raise ValueError(
                "graph memory strategy 'dedicated' keeps every executable and cannot hold a budget; "
                "use 'auto' or 'update' with a budget, or drop the budget"
            )

    @classmethod
    def of(cls, value: GraphMemoryPolicy | int | str | None) -> GraphMemoryPolicy:
        """A policy from what `tendril.graphed(memory=...)` accepts: a policy, a budget ("64MiB", bytes) or None."""
        if isinstance(value, GraphMemoryPolicy):
            return value
        return cls(budget=value)  # type: ignore[arg-type]  # parse_bytes reads strings in __post_init__

    def with_default_budget(self, config: Config) -> GraphMemoryPolicy:
        """This policy with the process default budget filled in where it names none (and may hold one)."""
        if self.budget is not None or config.graph_memory_budget is None:
            return self
        if self.strategy is MemoryStrategy.DEDICATED:
            return self
        return replace(self, budget=parse_bytes(config.graph_memory_budget))

    @property
    def resolved(self) -> MemoryStrategy:
        """The strategy that runs: `auto` is `dedicated` without a budget and `update` with one."""
        if self.strategy is MemoryStrategy.AUTO:
            return MemoryStrategy.DEDICATED if self.budget is None else MemoryStrategy.UPDATE
        return self.strategy


@dataclass(frozen=True)
class GraphOptions:
    """What a `GraphedCallable` does with its calls (see `tendril.graphed` for each field's meaning)."""

    buckets: Buckets | None = None
    max_graphs: int = DEFAULT_MAX_GRAPHS
    clone_outputs: bool = False
    warmup: int = 1
    memory: GraphMemoryPolicy = field(default_factory=GraphMemoryPolicy)

    def __post_init__(self) -> None:
        if self.max_graphs < 0:
            raise ValueError(f"max_graphs must be >= 0, got {self.max_graphs}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
