"""Graphed callables over Inductor's kernels: `tendril.graphed(fn, compile=...)`.

- **One compile for every length.** The function is compiled once by `torch.compile(fn, dynamic=True)` with
  Inductor's own CUDA graphs off (tendril graphs), so a new length runs, and is captured from, the code compiled
  for the first one. The compiler backend is wrapped so that each graph it compiles is counted
  (`CompileStats.compiles`): past the first call it grows only where dynamo must specialise (a length of 0 or 1,
  a new frame after a graph break, a guard that fails), which is what the recompile tests bound.
- **Capture after a warm-up.** A capture is preceded by at least one eager run (`GraphOptions.warmup` >= 1 with
  compile), so a recompile for a new shape happens there, never inside the capture.
- **Floats as constants.** Dynamo specialises the Python floats the function reads (`_with_static_floats`), so a
  frame is traced once rather than traced, compiled and restarted.
- **Persistent caches.** Inductor's FX graph cache and the AOTAutograd cache are turned on and, unless
  TORCHINDUCTOR_CACHE_DIR is set, kept under tendril's cache dir (`inductor_cache_dir`), so a second process loads
  the generated kernels instead of generating them again.
- **Attention kernels fixed at the compile.** Inductor bakes the attention kernel PyTorch picks while tracing into
  the compiled code, so the compile runs under the backend's capture restriction (`CudaBackend.sdpa_backends`), the
  kernels the graphs are captured with. `tendril.graphed(compile=...)`'s default backend has none: PyTorch's choice,
  cuDNN attention where PyTorch picks it, the fastest per call, whose host plan every new length pays once per
  process. `CudaBackend()`'s restriction (cuDNN attention left out, as for plain graphs) needs no plan. The
  restriction sets PyTorch's process-wide attention flags; a background compile's thread sets them for the whole
  process while it traces.
- **Foreground (default).** The first call that needs a capture compiles, by running the compiled function once
  on its arguments, then captures; every graph comes from compiled code.
- **Background (`CompileOptions(background=True)`).** The first call starts the compile on a side thread, on copies
  of its arguments and on a stream of its own. Until the compile is done, graphs already captured (ahead of time
  by `capture`, from the plain function) keep replaying and calls with a new key run eagerly (`Fallback.COMPILING`):
  Inductor's first run benchmarks kernels with device-wide synchronisations, which must not meet a capture on
  another thread. Once it is done, each key captured from the plain function is captured again from the compiled
  one at its next call (`recaptured_keys`; `switched_at_call` is the call that saw the compiled code first).
- **Failure.** A compile that raises leaves the callable on the plain function for good: the reason is kept in
  `CompileStats.failure` and warned once (`CompileFallbackWarning`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend
from torch.utils import _pytree as pytree

from tendril.config import Config
from tendril.graphs.capture import attention_restricted
from tendril.graphs.key import Flattened
from tendril.graphs.options import CompileOptions
from tendril.graphs.stats import Fallback


class CompileFallbackWarning(UserWarning):
    """Compiling a graphed callable's function failed; its graphs are captured from the plain function."""


@dataclass
class CompileStats:
    """What compiling did for one graphed callable (`GraphStats.compile`)."""

    state: str = "pending"
    """`pending` (no call yet), `compiling` (in the background), `ready`, or `failed`."""
    compiles: int = 0
    """Graphs the compiler backend compiled: the first call's frames, then each recompile."""
    compiled_by_first_call: int = 0
    """`compiles` when the compiling call ended; `recompiles` counts the ones after it."""
    compile_s: float = 0.0
    """Wall time of the call that compiled (tracing, code generation, and the first run)."""
    switched_at_call: int | None = None
    """The first call (1-based, `GraphStats.calls`) that found the compiled code ready."""
    compiled_keys: int = 0
    """Graphs captured from the compiled function."""
    recaptured_keys: int = 0
    """Keys first captured from the plain function, then captured again from the compiled one."""
    failure: str | None = None
    """Why compiling failed (the exception), when it did."""

    @property
    def recompiles(self) -> int:
        """Compiles after the compiling call: new frames or failed guards (a length of 1, say), one per graph."""
        return self.compiles - self.compiled_by_first_call if self.state == "ready" else 0

    def summary(self) -> str:
        """One line for `GraphStats.table()`."""
        line = f"compile {self.state}: {self.compiles} compiles in {self.compile_s:.1f} s ({self.recompiles} later), "
        line += f"{self.compiled_keys} graphs from compiled code ({self.recaptured_keys} recaptured), "
        line += f"switched at call {self.switched_at_call}"
        return line if self.failure is None else f"{line}; failure: {self.failure}"


def inductor_cache_dir(config: Config) -> Path:
    """Where Inductor keeps its caches for tendril: TORCHINDUCTOR_CACHE_DIR if the user set it, else
    `Config.cache_dir / "inductor"`."""
    return config.inductor_cache_dir or config.cache_dir / "inductor"


def enable_persistent_caches(config: Config) -> Path:
    """Turn on Inductor's FX graph cache and the AOTAutograd cache, in `inductor_cache_dir`; return that dir.

    Inductor takes its cache dir from TORCHINDUCTOR_CACHE_DIR, so the dir is exported there. Call it before the
    first compile of the process: Inductor fixes its cache dir at first use.
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    directory = inductor_cache_dir(config)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    return directory


class Compiler:
    """The compiled version of one graphed callable's function, and which function its next capture uses."""

    def __init__(
        self,
        fn: Callable[..., Any],
        options: CompileOptions,
        config: Config,
        name: str,
        sdpa_backends: Sequence[SDPBackend] | None = None,
    ) -> None:
        """`sdpa_backends`: the attention kernels the compile may pick from, those the graphs are captured with
        (None: PyTorch's choice)."""
        enable_persistent_caches(config)
        self.plain = fn
        self.options = options
        self.name = name
        self.sdpa_backends = sdpa_backends
        self.stats = CompileStats()
        self.compiled = _with_static_floats(torch.compile(fn, dynamic=True, backend=self._counted_backend()))
        self._thread: threading.Thread | None = None
        self._warned = False

    @property
    def ready(self) -> bool:
        return self.stats.state == "ready"

    def start(self, flat: Flattened) -> None:
        """At every call: a background compile starts at the first one (ahead-of-time captures come before it)."""
        if self.options.background and self.stats.state == "pending":
            self._start_thread(*_normal_copies(flat))

    def prepare(self, flat: Flattened, call: int) -> tuple[Fallback, str] | None:
        """Before a capture: a foreground compile runs at the first one; why the capture must wait, or None."""
        if not self.options.background and self.stats.state == "pending":
            self._compile(*_normal_copies(flat))
        self._report_failure()
        if self.stats.state == "compiling":
            return Fallback.COMPILING, f"compiling {self.name} in the background"
        self._note_switch(call)
        return None

    def current(self) -> tuple[Callable[..., Any], bool]:
        """The function the next capture records, and whether it is the compiled one."""
        return (self.compiled, True) if self.ready else (self.plain, False)

    def replaces(self, entry: Any, call: int) -> bool:
        """Whether `entry`, a graph captured from the plain function (`entry.compiled` False), is captured again now."""
        if entry.compiled or not self.ready:
            self._report_failure()
            return False
        self._note_switch(call)
        self.stats.recaptured_keys += 1
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a background compile ends (or `timeout` seconds pass); whether it has ended."""
        if self._thread is not None:
            self._thread.join(timeout)
        return self.stats.state != "compiling"

    # -- compiling -----------------------------------------------------------------------------------

    def _counted_backend(self) -> Callable[..., Any]:
        inner = _backend(self.options)

        def counted(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.stats.compiles += 1
            return inner(graph, example_inputs)

        return counted

    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Compile by running the compiled function once; the state ends `ready` or `failed`."""
        self.stats.state = "compiling"
        start = time.perf_counter()
        try:
            with torch.no_grad(), attention_restricted(self.sdpa_backends):
                self.compiled(*args, **kwargs)
        except Exception as error:  # any compiler error: the callable stays on the plain function, reason kept
            self.stats.failure = _reason(error)
            self.stats.state = "failed"
            return
        finally:
            self.stats.compile_s = time.perf_counter() - start
        self.stats.compiled_by_first_call = self.stats.compiles
        self.stats.state = "ready"

    def _start_thread(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        inference = torch.is_inference_mode_enabled()  # the thread compiles under the caller's mode (a guard)
        copies = (args, kwargs)
        devices = {leaf.device for leaf in pytree.tree_leaves(copies) if isinstance(leaf, torch.Tensor)}
        cuda = next((device for device in devices if device.type == "cuda"), None)
        if cuda is not None:
            torch.cuda.current_stream(cuda).synchronize()  # the copies are complete before another stream reads

        def run() -> None:
            if cuda is None:
                with torch.inference_mode(inference):
                    self._compile(*copies)
                return
            stream = torch.cuda.Stream(cuda)
            with torch.inference_mode(inference), torch.cuda.device(cuda), torch.cuda.stream(stream):
                self._compile(*copies)
            stream.synchronize()

        self.stats.state = "compiling"
        self._thread = threading.Thread(target=run, name=f"tendril-compile-{self.name}", daemon=True)
        self._thread.start()

    def _note_switch(self, call: int) -> None:
        if self.ready and self.stats.switched_at_call is None:
            self.stats.switched_at_call = call

    def _report_failure(self) -> None:
        if self.stats.state != "failed" or self._warned:
            return
        self._warned = True
        warnings.warn(
            f"tendril.graphed({self.name}, compile=...) could not compile: {self.stats.failure}. Its graphs are "
            "captured from the plain function (the reason stays in .stats.compile.failure).",
            CompileFallbackWarning,
            stacklevel=5,
        )


def _with_static_floats(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """`compiled`, run with dynamo specialising Python floats. Under `dynamic=True` dynamo would trace the floats a
    model reads (a scale, LayerNorm's eps, Dropout's p) as symbols; the compiler's pass that turns symbolic floats
    into tensors restarts dynamo's analysis with those it cannot turn as constants, so every frame would be traced
    twice and compiled once for nothing. A float that changes between calls recompiles instead (a guard on its
    value). Dynamo's config is process-wide: other compiles running meanwhile (a background compile's thread, say)
    see the setting too."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with torch._dynamo.config.patch(specialize_float=True):
            return compiled(*args, **kwargs)

    return call


def _normal_copies(flat: Flattened) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with each tensor copied as a normal tensor, as the placeholders that graphs are captured
    from are: compiling on an inference tensor would guard on its dispatch keys and recompile for the placeholders."""
    args, kwargs = flat.unflatten(list(flat.leaves))
    with torch.inference_mode(False):
        return pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))


def _reason(error: Exception) -> str:
    """One line naming a compile error and, for a compiler backend's failure that dynamo wraps, its cause."""
    cause = getattr(error, "inner_exception", None) or error.__cause__
    lines = [f"{type(e).__name__}: {str(e).strip()}".splitlines()[0] for e in (error, cause) if e is not None]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ({lines[1]})"


def _backend(options: CompileOptions) -> Callable[..., Any]:
    """The compiler backend of `options`: Inductor with its mode's settings and its own CUDA graphs off."""
    if options.backend != "inductor":
        from torch._dynamo import lookup_backend

        return lookup_backend(options.backend)
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = {**list_mode_options(options.mode.value, dynamic=True), "triton.cudagraphs": False}
    return functools.partial(compile_fx, config_patches=patches)
