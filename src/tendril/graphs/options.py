"""Options of a graphed callable: one typed object from `tendril.graphed` down to the backend.

`GraphOptions` holds what the dispatcher needs (buckets, bounds, output handling, warm-up runs);
`GraphMemoryPolicy` holds how the CUDA backend keeps the executables of the graphs (see
`tendril.graphs.executables`); `CompileOptions` holds how the function is compiled before its graphs are
captured (see `tendril.graphs.compiled`). Both validate at construction, so a bad value fails where it is written.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from tendril.graphs.memory import parse_bytes
from tendril.utils.checks import is_integer

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


class CompileMode(str, enum.Enum):
    """Inductor modes whose kernels a graphed callable captures. Inductor's own CUDA graphs stay off, since
    tendril does the graphing (`reduce-overhead` and `max-autotune` would graph a second time)."""

    DEFAULT = "default"
    MAX_AUTOTUNE = "max-autotune-no-cudagraphs"


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
"""`torch.compile` backends a graphed callable accepts: Inductor, and two of dynamo's debugging backends that
trace without generating code (quick on the CPU, for tests and to bisect a wrong answer)."""


@dataclass(frozen=True)
class CompileOptions:
    """`tendril.graphed(fn, compile=...)`: capture the graphs from `torch.compile(fn, dynamic=True)`.

    `mode`: Inductor's mode (`CompileMode`). `background`: compile on a side thread while calls keep
    running (see `tendril.graphs.compiled` for what runs meanwhile). `backend`: one of `COMPILE_BACKENDS`.
    """

    mode: CompileMode = CompileMode.DEFAULT
    background: bool = False
    backend: str = "inductor"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", CompileMode(self.mode))
        except ValueError:
            names = ", ".join(repr(m.value) for m in CompileMode)
            raise ValueError(f"compile mode {self.mode!r}: expected one of {names}") from None
        if not isinstance(self.background, bool):
            raise TypeError(f"compile background must be True or False, got {self.background!r}")
        if self.backend not in COMPILE_BACKENDS:
            raise ValueError(f"compile backend {self.backend!r}: expected one of {', '.join(COMPILE_BACKENDS)}")

    @classmethod
    def of(cls, value: CompileOptions | bool | str | None) -> CompileOptions | None:
        """What `tendril.graphed(compile=...)` accepts: False/None (no compiling), True, a mode name, or options."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, CompileOptions):
            return value
        if isinstance(value, str):
            return cls(mode=value)  # type: ignore[arg-type]  # __post_init__ reads the mode's name
        raise TypeError(
            f"compile={value!r}: expected True/False, a mode name ('default', 'max-autotune-no-cudagraphs') "
            "or a tendril.graphs.CompileOptions"
        )


@dataclass(frozen=True)
class GraphOptions:
    """What a `GraphedCallable` does with its calls (see `tendril.graphed` for each field's meaning)."""

    buckets: Buckets | None = None
    max_graphs: int = DEFAULT_MAX_GRAPHS
    clone_outputs: bool = False
    warmup: int = 1
    memory: GraphMemoryPolicy = field(default_factory=GraphMemoryPolicy)
    compile: CompileOptions | None = None

    def __post_init__(self) -> None:
        from tendril.graphs.buckets import Buckets

        if self.buckets is not None and not isinstance(self.buckets, Buckets):
            raise TypeError(f"buckets must be a tendril.Buckets (e.g. tendril.sequence_buckets({self.buckets!r})), got "
                            f"{type(self.buckets).__name__}")
        if not is_integer(self.max_graphs) or self.max_graphs < 0:
            raise ValueError(f"max_graphs must be an integer >= 0, got {self.max_graphs!r}")
        if not is_integer(self.warmup) or self.warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if not isinstance(self.clone_outputs, bool):
            raise TypeError(f"clone_outputs must be True or False, got {self.clone_outputs!r}")
        if self.compile is not None and self.warmup < 1:
            raise ValueError(
                f"warmup={self.warmup} with compile: a compiled function needs warmup >= 1, so that a recompile "
                "for a new shape runs before the capture rather than inside it"
            )
