"""Whether a graphed callable or graphed step may capture: the rules that do not depend on its history, and the
one warning per fallback reason that both give when a call runs eagerly."""

from __future__ import annotations

import warnings

from tendril.config import Config
from tendril.graphs.backend import Backend
from tendril.graphs.key import GraphKey
from tendril.graphs.stats import Fallback


def graphs_unavailable(backend: Backend, config: Config) -> tuple[Fallback, str] | None:
    """Why every call runs eagerly (the backend cannot capture here, or `TENDRIL_NO_GRAPHS`), or None."""
    if config.disable_graphs:
        return Fallback.GRAPHS_DISABLED, "TENDRIL_NO_GRAPHS is set"
    return backend.unavailable()


def placement_refusal(key: GraphKey, backend: Backend, graphs: int, max_graphs: int) -> tuple[Fallback, str] | None:
    """Why a new key cannot be captured whatever its history: tensors on a device the backend does not capture, on
    several devices, or `max_graphs` reached (`graphs` captured so far); None if it can."""
    devices = key.devices()
    refused = sorted(str(device) for device in devices if not backend.accepts(device))
    if refused:
        return Fallback.CPU_TENSOR, f"tensor arguments on {', '.join(refused)}"
    if len(devices) > 1:
        return Fallback.MIXED_DEVICES, f"tensor arguments on {', '.join(sorted(map(str, devices)))}"
    if graphs >= max_graphs:
        return Fallback.LIMIT, f"{graphs} graphs captured, max_graphs={max_graphs}"
    return None


class GraphFallbackWarning(UserWarning):
    """A graphed callable or step ran a call eagerly; issued once per reason per callable."""


class FallbackWarnings:
    """Warns once per fallback reason for one graphed callable or step (`label`, e.g. "tendril.graphed(GPT2)");
    later occurrences are only counted in its stats."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.warned: set[Fallback] = set()

    def warn(self, reason: Fallback, detail: str) -> None:
        """Warn about `reason` unless it was warned before; `stacklevel` points at the user's call (the callable's
        `__call__` -> its fallback -> here)."""
        if reason in self.warned:
            return
        self.warned.add(reason)
        warnings.warn(
            f"{self.label} runs eagerly: {reason.value} ({detail}). Later occurrences are counted in .stats.fallbacks "
            "without warning.",
            GraphFallbackWarning,
            stacklevel=4,
        )
