"""Budget accounting of the executable cache: what each executable is charged, and the learnt rate behind it.

The driver's memory per executable is measured around instantiations on the calling thread (cudaMemGetInfo), but
the driver takes it in chunks (most instantiations measure nothing, a few measure several executables' worth), so
one measurement says little. An executable of `n` nodes is charged `n x rate`, the rate in bytes per node learnt
from all measurements so far, starting from a prior (`PRIOR_BYTES_PER_NODE`, worth `PRIOR_NODES` nodes of
evidence). The budget holds for these charges plus reserved bytes (executables kept outside the cache).

Limit: executables recycle driver memory that destroyed ones freed, and such instantiations measure no growth; the
learnt rate then falls and more executables fit the budget than its bytes would hold fresh. A measurement above the
learnt rate raises every charge; the cache then evicts until they fit again.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

PRIOR_BYTES_PER_NODE = 4096
"""Driver bytes per graph node assumed before any measurement (a GPT-2 forward graph's, rounded up)."""
PRIOR_NODES = 4096
"""How many nodes of evidence the prior is worth against measurements."""


class Accounting:
    """Charges against a budget (None: no budget): the learnt bytes-per-node rate, the sum of the charges of the
    executables alive (kept as they come and go, recomputed when the rate changes), reserved bytes and how often an
    instantiation left the charges above the budget."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.reserved_bytes = 0
        """Driver bytes of executables outside the cache (never evicted) that count against the budget."""
        self.over_budget = 0
        """Instantiations that left the charges above the budget (one executable larger than all of it)."""
        self._measured_bytes = 0
        self._measured_nodes = 0
        self._charged: int | None = 0
        """Sum of the live executables' charges; None when it must be recomputed (the learnt rate changed). Updates
        change neither, so a switch's per-call work does not grow with the number of executables."""

    @property
    def bytes_per_node(self) -> float:
        """Learnt driver bytes per graph node: the measurements so far, weighed against the prior."""
        prior = PRIOR_BYTES_PER_NODE * PRIOR_NODES
        return (self._measured_bytes + prior) / (self._measured_nodes + PRIOR_NODES)

    def charge(self, nodes: int) -> int:
        """Driver bytes charged to an executable of `nodes` nodes."""
        return math.ceil(nodes * self.bytes_per_node)

    def learn(self, nodes: int, measured: int | None) -> bool:
        """Add a measurement of an executable of `nodes` nodes (None: unmeasured); True when the rate changed, and
        with it every charge."""
        if measured is None:
            return False
        self._measured_bytes += measured
        self._measured_nodes += nodes
        self._charged = None
        return True

    def admitted(self, nodes: int) -> int:
        """Count a new executable of `nodes` nodes; returns its charge."""
        charge = self.charge(nodes)
        if self._charged is not None:
            self._charged += charge
        return charge

    def released(self, nodes: int) -> None:
        """Stop counting an executable of `nodes` nodes (charged at the current rate, as the sum was made at)."""
        if self._charged is not None:
            self._charged -= self.charge(nodes)

    def live_bytes(self, live_nodes: Iterable[int]) -> int:
        """Charges of the live executables (their node counts, given in case the sum must be recomputed) plus
        reserved bytes."""
        if self._charged is None:
            self._charged = sum(self.charge(nodes) for nodes in live_nodes)
        return self._charged + self.reserved_bytes

    def fits(self, live_bytes: int, needed: int) -> bool:
        """Whether `needed` more bytes fit beside `live_bytes` (always, without a budget)."""
        return self.budget is None or live_bytes + needed <= self.budget

    def clear(self) -> None:
        """No executable is alive any more."""
        self._charged = 0
