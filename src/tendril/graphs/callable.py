"""`tendril.graphed`: run a PyTorch callable whose input shapes vary as shape-keyed CUDA graphs.

Each call is keyed by its arguments (`key.GraphKey`: tensor shapes, dtypes, devices, and the values
of non-tensor arguments). The first call with a new key captures a graph for it; later calls with
that key copy their tensors into the key's placeholders (skipping arguments that already are the
placeholder) and replay. With `buckets`, calls are first padded up to a declared size, so one graph
serves every length up to it.

Dispatch policy, in order (plain Python, tested without a GPU through `NullBackend`):

1. no CUDA, or `TENDRIL_NO_GRAPHS` -> eager (`Fallback.NO_CUDA`, `GRAPHS_DISABLED`);
2. grad mode on and an argument, or a parameter or buffer of the callable's modules, requiring grad -> eager
   (`REQUIRES_GRAD`; a graph records no autograd, see `trainable`);
3. a tensor of the callable's modules replaced or moved, or a module's training mode flipped, since the graphs were
   captured (`module_state`: they read tensors where they were, in the mode they were captured in) -> every graph is
   dropped (`stats.module_changes`, with a warning);
4. the call's key has a graph -> replay it;
5. the key cannot be graphed -> eager: `UNKEYABLE` (unhashable argument), `CPU_TENSOR`,
   `MIXED_DEVICES`, or the reason its capture failed before (a failed key is never retried);
6. `max_graphs` graphs exist already -> eager (`LIMIT`); existing graphs keep replaying;
7. capture; if that fails (`HOST_SYNC`, `CAPTURE_ERROR`) or the function wrote into its inputs
   (`MUTATES_INPUTS`), the key runs eagerly from then on.

Every eager call is counted in `stats.fallbacks` with its reason, and each reason warns once per
callable (`admission.GraphFallbackWarning`). Eager fallbacks call the original function on the original
(unpadded) arguments, so they return exactly what the function returns.

Output lifetime (see `outputs`): returned tensors live in graph memory shared by all of the
callable's graphs and are overwritten by its next call. Clone what you keep, pass
`clone_outputs=True`, or set `TENDRIL_DEBUG=1` to have stale uses raise `StaleOutputError`.

With `compile=...` (see `compiled`), graphs are captured from `torch.compile(fn, dynamic=True)`'s kernels.

Inputs (see `inputs`): a call copies its tensors into its graph's placeholders. `zero_copy()` and
`carry(...)` plug in `tendril.graphs.zero_copy`, which places inputs so that nothing needs copying; a
callable that uses neither never creates it, and its calls check for it once.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tendril.config import Config
from tendril.graphs.admission import FallbackWarnings, graphs_unavailable, placement_refusal
from tendril.graphs.backend import Backend, Captured, CaptureFailed
from tendril.graphs.buckets import Buckets, PaddedCall, cut_back, follow_length, parameter_positions, probe_call
from tendril.graphs.examples import Call as Call
from tendril.graphs.examples import as_call, progress_bar
from tendril.graphs.inputs import InputPlacement, Staging
from tendril.graphs.key import Flattened, GraphKey, Unkeyable, flatten_call, key_of
from tendril.graphs.memory import PlaceholderArena
from tendril.graphs.module_state import ModuleChangedWarning, ModuleState
from tendril.graphs.options import DEFAULT_MAX_GRAPHS, CompileOptions, GraphMemoryPolicy, GraphOptions
from tendril.graphs.outputs import Generation, clone_outputs, guard_outputs
from tendril.graphs.stats import Fallback, GraphRecord, GraphStats
from tendril.graphs.trainable import modules_of, needs_autograd
from tendril.graphs.turns import Turns

if TYPE_CHECKING:
    from tendril.graphs.compiled import Compiler
    from tendril.graphs.zero_copy.plugin import ZeroCopy

_KEY_CACHE_SIZE = 4096
"""Distinct call fingerprints remembered by `GraphedCallable._key` (cleared when full)."""


@dataclass
class _Entry:
    key: GraphKey
    leaf_indices: list[int]
    placeholders: list[torch.Tensor]
    captured: Captured
    record: GraphRecord
    staging: Staging
    cut_axes: tuple[tuple[int, ...], ...] | None = None
    """Per output tensor, the dimensions that follow a bucket's padded length (`buckets.follow_length`)."""
    compiled: bool = False
    """Captured from the compiled function (`tendril.graphs.compiled`)."""


class GraphedCallable:
    """`fn` run as shape-keyed CUDA graphs sharing one memory pool. Create with `tendril.graphed`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        options: GraphOptions,
        *,
        backend: Backend | None = None,
        config: Config | None = None,
        name: str | None = None,
    ) -> None:
        """`backend` defaults to `CudaBackend(memory=options.memory)`; a memory policy other than the default
        configures that backend, so it cannot come with another backend (`ValueError`: pass it there)."""
        if config is None:
            from tendril.config import settings

            config = settings
        if backend is None:
            from tendril.graphs.capture import GRAPH_SDPA_BACKENDS
            from tendril.graphs.cuda_backend import CudaBackend

            attention = None if options.compile is not None else GRAPH_SDPA_BACKENDS
            backend = CudaBackend(attention, memory=options.memory)
        elif options.memory != GraphMemoryPolicy():
            raise ValueError(
                "memory= configures the default CUDA backend; with your own backend, pass the policy to it "
                "(CudaBackend(memory=...))"
            )
        self.fn = fn
        self.options = options
        self.config = config
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.stats = GraphStats()
        self._backend = backend
        self._entries: dict[GraphKey, _Entry] = {}
        self._arena = PlaceholderArena()
        self._inputs = InputPlacement(self._arena, self.stats)
        self._zero_copy: ZeroCopy | None = None
        """The zero-copy plug-in, made by the first `zero_copy()` or `carry(...)` (`_plug_in`)."""
        self._generation = Generation()
        self._keys: dict[Any, tuple[GraphKey | Unkeyable, list[int]]] = {}
        self._warnings = FallbackWarnings(f"tendril.graphed({self.name})")
        self._module_state: ModuleState | None = None  # the callable's modules, found at the first call
        self._positions = parameter_positions(fn) if options.buckets is not None else {}
        self._unavailable = graphs_unavailable(backend, config)
        self._turns = Turns(self.name, wait=options.clone_outputs, active=self._unavailable is None)
        self._compiler: Compiler | None = None
        if options.compile is not None:
            from tendril.graphs.compiled import Compiler

            attention = getattr(backend, "sdpa_backends", None)
            self._compiler = Compiler(fn, options.compile, config, self.name, attention)
            self.stats.compile = self._compiler.stats

    def __repr__(self) -> str:
        return f"GraphedCallable({self.name}, graphs={len(self._entries)}/{self.options.max_graphs})"

    def keys(self) -> list[GraphKey]:
        """Keys with a captured graph, in capture order."""
        return list(self._entries)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._zero_copy is None:
            return self._call(args, kwargs)
        with self._turns:  # zero-copy places every call's inputs in shared lanes
            return self._zero_copy.call(self._call, args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.stats.calls += 1
        if self._unavailable is not None:
            return self._eager(args, kwargs, *self._unavailable)
        autograd = needs_autograd(args, kwargs, self._check_modules(modes=False))
        if autograd is not None:
            detail = f"{autograd}; call under torch.no_grad()/inference_mode() to graph it"
            return self._eager(args, kwargs, Fallback.REQUIRES_GRAD, detail)
        with self._turns:  # eager training calls above may overlap; calls that may touch the graphs may not
            return self._graph_call(args, kwargs)

    def _graph_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call that may graph (`_call`'s checks passed): replay, capture, or eager for its key."""
        self._check_modules(tensors=False)  # modes only where the call may graph: eager training calls keep the graphs
        padded = self._pad(args, kwargs)
        flat = flatten_call(padded.args, padded.kwargs) if padded is not None else flatten_call(args, kwargs)
        if self._compiler is not None:
            self._compiler.start(flat)
        key, indices = self._key(flat)
        key = self._inputs.key_for(key, flat, indices)
        entry = self._entries.get(key) if isinstance(key, GraphKey) else None
        if entry is not None and self._compiler is not None and self._compiler.replaces(entry, self.stats.calls):
            del self._entries[entry.key]
            entry = None
        if entry is None:
            admitted = self._admit(key, flat, padded)
            if not isinstance(admitted, _Entry):
                return self._eager(args, kwargs, *admitted)
            entry = admitted
        if padded is not None:
            self.stats.padded_calls += 1
        outputs = self._replay(entry, flat)
        if padded is not None and entry.cut_axes is not None and padded.length != padded.bucket:
            outputs = cut_back(outputs, entry.cut_axes, padded.length)
        if self.options.clone_outputs:
            return clone_outputs(outputs)
        if self.config.debug:
            return guard_outputs(outputs, self._generation, self.name)
        return outputs

    def capture(self, examples: Iterable[Any], *, progress: bool = True) -> int:
        """Capture graphs ahead of time for `examples`, largest first; return how many new graphs there are.

        Each example is a tuple of positional arguments, a dict of keyword arguments, a `Call`, or a
        single tensor. Largest first lets every smaller graph reuse the largest one's memory and
        sizes each placeholder buffer once. Examples that cannot be graphed are recorded in `stats`.
        """
        with self._turns:
            pending: dict[GraphKey, tuple[Flattened, PaddedCall | None]] = {}
            for example in examples:
                args, kwargs = as_call(example)
                padded = self._pad(args, kwargs)
                if padded is not None:
                    args, kwargs = padded.args, padded.kwargs
                flat = flatten_call(args, kwargs)
                key = key_of(flat)
                if isinstance(key, GraphKey) and key not in self._entries:
                    pending.setdefault(key, (flat, padded))
                elif isinstance(key, Unkeyable):
                    self._note(Fallback.UNKEYABLE, key.reason)
            if self._unavailable is not None:
                if pending:
                    self._note(*self._unavailable)
                return 0
            self._check_modules()
            order = sorted(pending.items(), key=lambda item: item[0].nbytes, reverse=True)
            for key, (flat, _) in order:
                for index, spec in zip(flat.tensor_indices(), key.tensors, strict=True):
                    if self._backend.accepts(spec.device):
                        self._arena.reserve(index, spec)
            before = len(self._entries)
            for key, (flat, padded) in progress_bar(order, self.name, progress):
                admitted = self._admit(key, flat, padded)
                if not isinstance(admitted, _Entry):
                    self._note(*admitted)
            return len(self._entries) - before

    def static_inputs(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The placeholders of this call's graph (captured if needed) in the call's structure.

        Writing inputs straight into them and calling `fast(*args, **kwargs)` with them skips the copy.
        """
        with self._turns:
            padded = self._pad(args, kwargs)
            if padded is not None:
                args, kwargs = padded.args, padded.kwargs
            flat = flatten_call(args, kwargs)
            key = key_of(flat)
            if self._unavailable is None:
                self._check_modules()
            entry = self._entries.get(key) if isinstance(key, GraphKey) else None
            if entry is None:
                if self._unavailable is not None:
                    raise RuntimeError(f"{self.name} cannot capture graphs: {self._unavailable[1]}")
                admitted = self._admit(key, flat, padded)
                if not isinstance(admitted, _Entry):
                    raise RuntimeError(f"{self.name} cannot graph this call: {admitted[0].value}: {admitted[1]}")
                entry = admitted
            leaves = list(flat.leaves)
            for index, placeholder in zip(entry.leaf_indices, entry.placeholders, strict=True):
                leaves[index] = placeholder
            return flat.unflatten(leaves)

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """With `compile=...`: block until a background compile ends (or `timeout` s pass); whether it ended."""
        return self._compiler.wait(timeout) if self._compiler is not None else True

    def inputs_for(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Writable views of the placeholders the graph for this call reads, in the call's structure.

        Write the next call's inputs into them (`torch.index_select(..., out=view)`, `view.copy_(...)`)
        and pass them: the call copies nothing. They are the placeholders of the copy lane, shared by
        all shapes of each argument, so a call with other inputs overwrites them.
        """
        return self.static_inputs(*args, **kwargs)

    @contextlib.contextmanager
    def zero_copy(self) -> Iterator[None]:
        """Within this block, ops producing this callable's inputs write them straight into its placeholders.

        Learned from the copies calls make, verified at every call, and counted in `stats` (bytes copied,
        copies avoided, redirects, mispredictions); a wrong prediction costs a copy, never a wrong
        result (see `tendril.graphs.zero_copy`).
        """
        with self._plug_in().block():
            yield

    def carry(self, output: int | str | tuple[int | str, ...], input: int | str) -> GraphedCallable:
        """Declare loop-carried state: the tensors at `output` of call t are the argument `input` of call t+1.

        `output` indexes the function's result (an index or key, or a tuple of them for nested results);
        `input` is a positional index or a keyword name; both sides may be containers of tensors (a KV
        cache), matched leaf by leaf. Graphs then write those outputs straight into the next call's
        placeholders (double-buffered, see `tendril.graphs.zero_copy.carry`), so passing them back copies nothing.
        Declare carries before the first call; returns the callable.
        """
        if self._entries:
            raise RuntimeError(
                f"{self.name}: declare carry(...) before the first call or capture (graphs already captured "
                "would not write the carried outputs where the next call reads them)"
            )
        self._plug_in().carry.declare(output, input)
        return self

    def _plug_in(self) -> ZeroCopy:
        """The zero-copy plug-in, made on first use; from then on it places every call's inputs."""
        if self._zero_copy is None:
            from tendril.graphs.zero_copy.plugin import ZeroCopy

            captured = [(e.leaf_indices, e.placeholders, e.captured.outputs) for e in self._entries.values()]
            self._zero_copy = ZeroCopy(self._arena, self.stats, captured)
            self._inputs = self._zero_copy
        return self._zero_copy

    def _pad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PaddedCall | None:
        buckets = self.options.buckets
        return buckets.pad(args, kwargs, self._positions) if buckets is not None else None

    def _key(self, flat: Flattened) -> tuple[GraphKey | Unkeyable, list[int]]:
        """`key_of(flat)` and its tensor leaf indices, through a cache keyed by a cheap fingerprint.

        The fingerprint holds exactly what the key is made of (the structure; shape, dtype and device of
        each tensor leaf; type and value of every other leaf), as plain tuples that hash and compare several
        times faster than the key's dataclasses; equal fingerprints have equal keys.
        """
        try:
            fingerprint = (
                flat.structure,
                tuple(
                    [
                        (leaf.shape, leaf.dtype, leaf.device) if isinstance(leaf, torch.Tensor) else (type(leaf), leaf)
                        for leaf in flat.leaves
                    ]
                ),
            )
            cached = self._keys.get(fingerprint)
        except TypeError:  # an unhashable leaf: key_of says why
            return key_of(flat), []
        if cached is None:
            if len(self._keys) >= _KEY_CACHE_SIZE:
                self._keys.clear()
            cached = (key_of(flat), flat.tensor_indices())
            self._keys[fingerprint] = cached
        return cached

    # -- policy --------------------------------------------------------------------------------------

    def _refusal(self, key: GraphKey | Unkeyable) -> tuple[Fallback, str] | None:
        """Why a key without a graph must run eagerly, or None if it may be captured."""
        if isinstance(key, Unkeyable):
            return Fallback.UNKEYABLE, key.reason
        failed = self.stats.failed_keys.get(key)
        if failed is not None:
            return failed, f"capture of {key} failed before"
        return placement_refusal(key, self._backend, len(self._entries), self.options.max_graphs)

    def _admit(
        self, key: GraphKey | Unkeyable, flat: Flattened, padded: PaddedCall | None = None
    ) -> _Entry | tuple[Fallback, str]:
        refusal = self._refusal(key)
        if refusal is None and self._compiler is not None:
            refusal = self._compiler.prepare(flat, self.stats.calls)
        if refusal is not None:
            return refusal
        assert isinstance(key, GraphKey)
        fn, compiled = self._compiler.current() if self._compiler is not None else (self.fn, False)
        probe = probe_call(self.fn, self.options.buckets, self._positions, padded)
        if isinstance(probe, str):
            self.stats.failed_keys[key] = Fallback.PADDED_OUTPUTS
            return Fallback.PADDED_OUTPUTS, probe
        indices = flat.tensor_indices()
        key, placeholders = self._inputs.placeholders(key, flat, indices)
        leaves = list(flat.leaves)
        for index, placeholder in zip(indices, placeholders, strict=True):
            leaves[index] = placeholder
        args, kwargs = flat.unflatten(leaves)
        versions = [placeholder._version for placeholder in placeholders]
        fn = self._inputs.wrap(_no_grad(fn), args, kwargs, key, indices, placeholders)
        try:
            captured = self._backend.capture(fn, args, kwargs, key, self.options.warmup)
        except CaptureFailed as failure:
            self.stats.failed_keys[key] = failure.reason
            self._sync_memory_stats()
            return failure.reason, failure.detail
        mutated = [i for i, (p, v) in enumerate(zip(placeholders, versions, strict=True)) if p._version != v]
        if mutated:
            del captured
            self.stats.failed_keys[key] = Fallback.MUTATES_INPUTS
            return Fallback.MUTATES_INPUTS, f"tensor argument(s) {mutated} of {key} were written in place"
        record = GraphRecord(
            key, captured.capture_ms, captured.pool_growth_bytes, captured.driver_bytes, phases_ms=captured.phases_ms
        )
        if captured.memory is not None:
            record.memory = captured.memory
        cut_axes = None
        if padded is not None and probe is not None:
            traced = follow_length(captured.outputs, probe.outputs, padded.bucket, probe.length)
            if isinstance(traced, str):
                del captured
                self.stats.failed_keys[key] = Fallback.PADDED_OUTPUTS
                return Fallback.PADDED_OUTPUTS, f"bucket {padded.bucket}: {traced}"
            cut_axes = traced
        captured.outputs = self._inputs.captured(key, indices, placeholders, captured.outputs)
        staging = Staging.of(indices, placeholders)
        entry = _Entry(key, indices, placeholders, captured, record, staging, cut_axes, compiled)
        if self._compiler is not None:
            self._compiler.stats.compiled_keys += compiled
        self._check_modules(modes=False)  # what this capture assigned (lazy initialisation) is what its graph read
        self._entries[key] = entry
        self.stats.graphs[key] = record
        self._sync_memory_stats()
        return entry

    def _check_modules(self, tensors: bool = True, modes: bool = True) -> ModuleState:
        """The callable's modules' state, brought up to date: if a tensor was replaced or moved (`tensors`) or a mode
        flipped (`modes`) since the capture, every graph is dropped (later calls capture again), counted and warned."""
        if self._module_state is None:
            self._module_state = ModuleState(modules_of(self.fn))
        state = self._module_state
        change = (state.changed_tensors() if tensors else None) or (state.changed_mode() if modes else None)
        if change is not None:
            state.renew()
            if self._entries:
                self._entries.clear()
                self._backend.forget_graphs()
                self.stats.module_changes += 1
                self.stats.module_change_detail = change
                warnings.warn(f"tendril.graphed({self.name}): {change} since its graphs were captured; they are "
                              "dropped and captured again", ModuleChangedWarning, stacklevel=4)
        return state

    # -- execution -----------------------------------------------------------------------------------

    def _replay(self, entry: _Entry, flat: Flattened) -> Any:
        if entry.captured.before_inputs is not None:
            entry.captured.before_inputs()
        self._inputs.stage(entry.staging, entry.key, flat.leaves)
        self._generation.value += 1
        entry.captured.replay()
        entry.record.replays += 1
        self.stats.replays += 1
        return entry.captured.outputs

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: Fallback, detail: str) -> Any:
        self.stats.record_fallback(reason, detail)
        self._warnings.warn(reason, detail)
        return self.fn(*args, **kwargs)

    def _note(self, reason: Fallback, detail: str) -> None:
        """Record a reason found while capturing ahead of time (no call ran eagerly)."""
        self.stats.fallback_details.setdefault(reason, detail)
        self._warnings.warn(reason, detail)


    def _sync_memory_stats(self) -> None:
        self.stats.pool_bytes = self._backend.pool_bytes()
        self.stats.placeholder_bytes = self._arena.nbytes


def graphed(
    fn: Callable[..., Any],
    *,
    buckets: Buckets | None = None,
    max_graphs: int = DEFAULT_MAX_GRAPHS,
    clone_outputs: bool = False,
    warmup: int = 1,
    memory: GraphMemoryPolicy | int | str | None = None,
    compile: CompileOptions | bool | str = False,
    backend: Backend | None = None,
    config: Config | None = None,
) -> GraphedCallable:
    """Run `fn` (an `nn.Module` or any function of tensors) as CUDA graphs keyed by its argument shapes.

    `buckets` pads calls up to declared sizes (see `tendril.graphs.buckets.sequence_buckets`); `max_graphs` bounds
    the number of graphs (new keys past it run eagerly); `clone_outputs=True` returns copies instead of views of graph
    memory (which the next call overwrites), and lets calls from several threads take turns, where otherwise a call
    overlapping another raises (`turns`); `warmup` eager runs precede each capture. `backend` defaults to CUDA
    (`NullBackend` simulates it for tests). Without CUDA every call runs eagerly, with one warning.

    `memory` bounds the device memory the driver holds for the graphs' executables: a budget ("256MiB", or bytes) or a
    `GraphMemoryPolicy` (budget, strategy, prefetching; see `tendril.graphs.options` and `tendril.graphs.executables`).
    Under a budget, captured graphs stay on the host and executables are made on demand, with results identical to
    one executable per graph. It configures the default backend, so it cannot be combined with `backend=`.

    `compile` captures the graphs from Inductor's kernels instead of the function's own: True, an Inductor mode
    ("default", "max-autotune-no-cudagraphs") or a `CompileOptions` (background compiling, a debugging
    backend). The function is compiled once for dynamic shapes, with persistent caches under tendril's cache
    dir; `.stats.compile` counts compiles and records the switch, or why compiling failed (then graphs are
    captured from the plain function, with one warning). With `compile`, the default backend keeps PyTorch's attention
    choice (cuDNN attention where PyTorch picks it), which the compiled code bakes in: the fastest per call, for a
    host plan per new length in each process; `backend=CudaBackend()` compiles and captures with the plain graphs'
    restriction instead (`capture.GRAPH_SDPA_BACKENDS`). See `tendril.graphs.compiled`.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable (a module or a function of tensors), got {type(fn).__name__}")
    options = GraphOptions(buckets, max_graphs, clone_outputs, warmup, GraphMemoryPolicy.of(memory),
                           CompileOptions.of(compile))
    return GraphedCallable(fn, options, backend=backend, config=config)


def _no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run
