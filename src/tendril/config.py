"""tendril's configuration: one typed object, with every environment variable read here and nowhere else.

`tendril.settings` is the process-wide instance, read from the environment at import. Code takes the
settings it needs from it (or from an explicit `Config` passed in), so tests can build their own.

| variable                    | field               | meaning                                                     |
|-----------------------------|---------------------|-------------------------------------------------------------|
| TENDRIL_DEBUG               | debug               | expensive invariant checks (input addresses, stale reads)   |
| TENDRIL_NO_GRAPHS           | disable_graphs      | run every graphed callable eagerly (to bisect a bad answer) |
| TENDRIL_CACHE_DIR           | cache_dir           | where compiled helper kernels are cached on disk            |
| TENDRIL_GRAPH_MEMORY_BUDGET | graph_memory_budget | default device-memory budget of executables ("256MiB")      |
| TENDRIL_PDL                 | pdl                 | programmatic dependent launch of decode kernels (0: off)    |
| TENDRIL_WEIGHT_COPIES       | weight_copies       | K-contiguous decode copies of GPT-2's weights (0: none)     |
| TRITON_INTERPRET            | triton_interpret    | Triton's CPU interpreter (Triton's variable, read here too) |
| TORCHINDUCTOR_CACHE_DIR     | inductor_cache_dir  | Inductor caches of `graphed(compile=)` (else under cache_dir) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "").strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tendril"


@dataclass(frozen=True)
class Config:
    """Process-wide settings. Defaults suit production; `debug` turns on expensive checks."""

    debug: bool = False
    """Check placeholder addresses at replay and detect reads of outputs a later replay overwrote."""
    disable_graphs: bool = False
    """Run every graphed callable eagerly; each call is counted as a fallback with this reason."""
    cache_dir: Path = field(default_factory=_default_cache_dir)
    """Directory for compiled helper kernels (NVRTC output)."""
    graph_memory_budget: str | None = None
    """Budget for the driver memory of graph executables when a graphed callable names none ("256MiB"); it also
    applies to the graphs `tendril.generate` builds. None: one executable per graph, no bound."""
    pdl: bool = True
    """Launch the fused decode kernels with programmatic dependent launch where the GPU supports it."""
    weight_copies: bool = True
    """GPT-2's fused decode keeps K-contiguous copies of its Conv1D weights for launches of few rows
    (`Projection.with_copies`): faster one-token and beam steps for the layers' weight memory once more. Off: they
    read the model's own layout."""
    triton_interpret: bool = False
    """Triton kernels run in Triton's interpreter (on CPU tensors), so CPU paths that bypass Triton must not."""
    inductor_cache_dir: Path | None = None
    """Where Inductor keeps its caches for `graphed(compile=...)`; None: `cache_dir / "inductor"`."""

    def __post_init__(self) -> None:
        """Directories may be given as strings; they are kept as `Path`s."""
        object.__setattr__(self, "cache_dir", Path(self.cache_dir))
        if self.inductor_cache_dir is not None:
            object.__setattr__(self, "inductor_cache_dir", Path(self.inductor_cache_dir))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        env = os.environ if env is None else env
        cache = env.get("TENDRIL_CACHE_DIR")
        return cls(
            debug=_flag(env, "TENDRIL_DEBUG"),
            disable_graphs=_flag(env, "TENDRIL_NO_GRAPHS"),
            cache_dir=Path(cache) if cache else _default_cache_dir(),
            graph_memory_budget=env.get("TENDRIL_GRAPH_MEMORY_BUDGET", "").strip() or None,
            pdl=_flag(env, "TENDRIL_PDL") if env.get("TENDRIL_PDL", "").strip() else True,
            weight_copies=_flag(env, "TENDRIL_WEIGHT_COPIES") if env.get("TENDRIL_WEIGHT_COPIES", "").strip() else True,
            triton_interpret=_flag(env, "TRITON_INTERPRET"),
            inductor_cache_dir=Path(env["TORCHINDUCTOR_CACHE_DIR"]) if env.get("TORCHINDUCTOR_CACHE_DIR") else None,
        )


settings = Config.from_env()
