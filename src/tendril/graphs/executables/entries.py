"""The cache's bookkeeping: registered graphs (`Source`), their executables (`Executable`, each in an explicit
`ExecutableState`) and who holds what (`ExecutableTable`)."""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tendril.graphs.executables.accounting import Accounting
from tendril.graphs.stats import GraphMemory


class ExecutableState(enum.Enum):
    """Where an executable is in its life. Only a `READY` one is launched or switched; `INSTANTIATING` and `UPDATING`
    ones are prefetches no call has taken yet (a call waits for their background operation first); a `DESTROYING` or
    `DESTROYED` one is out of the cache and never handed out again."""

    READY = "ready"
    """Made; runs its holder's graph at its next launch (or the graph its launch switches it to)."""
    INSTANTIATING = "instantiating"
    """Being instantiated for its holder's graph on the background thread (no handle until taken)."""
    UPDATING = "updating"
    """Being updated to its holder's graph on the background thread, after its last launch."""
    DESTROYING = "destroying"
    """Evicted; queued for destruction on the background thread, after its last launch."""
    DESTROYED = "destroyed"
    """Evicted and destroyed on the calling thread (or forgotten after its background operation failed)."""


PENDING = frozenset({ExecutableState.INSTANTIATING, ExecutableState.UPDATING})


@dataclass(eq=False)
class Executable:
    handle: Any
    """The driver's handle (the CUDA backend's is an `ExecutableChain`); None while `INSTANTIATING`."""
    family: str
    nodes: int
    holder: Hashable
    """The key whose graph the executable runs now (or will, once its background operation has completed)."""
    last_used: int
    state: ExecutableState = ExecutableState.READY
    background: Future[Any] | None = None
    """The background operation of a pending executable: its future gives the handle and the measured bytes
    (`INSTANTIATING`) or the `UpdateOutcome` (`UPDATING`)."""

    @property
    def pending(self) -> bool:
        return self.state in PENDING


@dataclass
class Source:
    """A registered graph: what the driver makes executables from, its size, topology family and statistics."""

    graph: Any
    nodes: int
    family: str
    memory: GraphMemory


class ExecutableTable:
    """The registered graphs and the executables alive (pending ones included), by holder and by family, with
    each holder's `GraphMemory.executable_bytes` and the accounting's sum of charges kept in step."""

    def __init__(self, accounting: Accounting) -> None:
        self.accounting = accounting
        self.sources: dict[Hashable, Source] = {}
        self.live: list[Executable] = []
        self.holding: dict[Hashable, Executable] = {}
        self._families: dict[str, list[Executable]] = {}

    def __iter__(self) -> Iterator[Executable]:
        return iter(self.live)

    def __len__(self) -> int:
        return len(self.live)

    def members(self, family: str) -> list[Executable]:
        """The live executables of `family` (a switch looks at its graph's family only)."""
        return self._families.get(family, [])

    def families(self) -> set[str]:
        return set(self._families)

    def live_bytes(self) -> int:
        return self.accounting.live_bytes(e.nodes for e in self.live)

    def admit(self, executable: Executable) -> None:
        self.live.append(executable)
        self._families.setdefault(executable.family, []).append(executable)
        self.holding[executable.holder] = executable
        self.sources[executable.holder].memory.executable_bytes = self.accounting.admitted(executable.nodes)

    def forget(self, executable: Executable) -> None:
        self.live.remove(executable)
        self._leave_family(executable)
        self.accounting.released(executable.nodes)
        del self.holding[executable.holder]
        self.sources[executable.holder].memory.executable_bytes = 0

    def move_holder(self, executable: Executable, key: Hashable) -> None:
        """`executable` runs `key`'s graph from now on (switched, or being switched)."""
        self.sources[executable.holder].memory.executable_bytes = 0
        del self.holding[executable.holder]
        executable.holder = key
        self.holding[key] = executable
        self.sources[key].memory.executable_bytes = self.accounting.charge(executable.nodes)

    def refile(self, executable: Executable, family: str) -> None:
        """Move `executable` into `family` (its graph's, after a split)."""
        self._leave_family(executable)
        executable.family = family
        self._families.setdefault(family, []).append(executable)

    def learn(self, nodes: int, measured: int | None) -> None:
        """Add a measurement to the learnt rate; every holder's `executable_bytes` follows the new charges."""
        if self.accounting.learn(nodes, measured):
            for executable in self.live:
                self.sources[executable.holder].memory.executable_bytes = self.accounting.charge(executable.nodes)

    def holder_keys(self) -> list[Hashable]:
        """Keys whose graph has an executable now (pending ones included), least recently used first."""
        return [e.holder for e in sorted(self.live, key=lambda e: e.last_used)]

    def pending_keys(self) -> list[Hashable]:
        """Keys whose prefetched executable no call has taken yet."""
        return [e.holder for e in self.live if e.pending]

    def family(self, key: Hashable) -> str:
        return self.sources[key].family

    def total(self, counter: str) -> int:
        """The sum of one `GraphMemory` counter over the registered graphs."""
        return sum(getattr(source.memory, counter) for source in self.sources.values())

    def clear(self) -> None:
        for executable in self.live:
            self.sources[executable.holder].memory.executable_bytes = 0
        self.live.clear()
        self._families.clear()
        self.holding.clear()
        self.accounting.clear()

    def _leave_family(self, executable: Executable) -> None:
        members = self._families[executable.family]
        members.remove(executable)
        if not members:
            del self._families[executable.family]
