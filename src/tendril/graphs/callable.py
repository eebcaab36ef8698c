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
3. the call's key has a graph -> replay it;
4. the key cannot be graphed -> eager: `UNKEYABLE` (unhashable argument), `CPU_TENSOR`,
   `MIXED_DEVICES`, or the reason its capture failed before (a failed key is never retried);
5. `max_graphs` graphs exist already -> eager (`LIMIT`); existing graphs keep replaying;
6. capture; if that fails (`HOST_SYNC`, `CAPTURE_ERROR`) or the function wrote into its inputs
   (`MUTATES_INPUTS`), the key runs eagerly from then on.

Every eager call is counted in `stats.fallbacks` with its reason, and each reason warns once per
callable (`GraphFallbackWarning`). Eager fallbacks call the original function on the original
(unpadded) arguments, so they return exactly what the function returns.

Output lifetime (see `outputs`): returned tensors live in graph memory shared by all of the
callable's graphs and are overwritten by its next call. Clone what you keep, pass
`clone_outputs=True`, or set `TENDRIL_DEBUG=1` to have stale uses raise `StaleOutputError`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tendril.config import Config
from tendril.graphs.alias import Lanes, Staging, ZeroCopyMode, ZeroCopyPredictor, lane_of, stage_inputs
from tendril.graphs.backend import Backend, Captured, CaptureFailed
from tendril.graphs.buckets import Buckets, parameter_positions
from tendril.graphs.carry import CarryPlan
from tendril.graphs.key import Flattened, GraphKey, Unkeyable, flatten_call, key_of
from tendril.graphs.memory import PlaceholderArena
from tendril.graphs.outputs import Generation, clone_outputs, guard_outputs
from tendril.graphs.stats import Fallback, GraphRecord, GraphStats
from tendril.graphs.trainable import GradPolicy

DEFAULT_MAX_GRAPHS = 64
_KEY_CACHE_SIZE = 4096
"""Distinct call fingerprints remembered by `GraphedCallable._key` (cleared when full)."""


class GraphFallbackWarning(UserWarning):
    """A graphed callable ran a call eagerly; issued once per reason per callable."""


@dataclass(frozen=True)
class Call:
    """One example call for ahead-of-time capture: `fast.capture([Call((ids,), {"attention_mask": m}), ...])`."""

    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None


@dataclass
class _Entry:
    key: GraphKey
    leaf_indices: list[int]
    placeholders: list[torch.Tensor]
    captured: Captured
    record: GraphRecord
    staging: Staging


class GraphedCallable:
    """`fn` run as shape-keyed CUDA graphs sharing one memory pool. Create with `tendril.graphed`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        buckets: Buckets | None = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        clone_outputs: bool = False,
        warmup: int = 1,
        backend: Backend | None = None,
        config: Config | None = None,
        name: str | None = None,
        graph_memory_budget: int | str | None = None,
        graph_memory_strategy: str = "auto",
        graph_memory_prefetch: bool = True,
    ) -> None:
        if max_graphs < 0:
            raise ValueError(f"max_graphs must be >= 0, got {max_graphs}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if config is None:
            from tendril.config import settings

            config = settings
        if backend is None:
            from tendril.graphs.cuda_backend import CudaBackend

            backend = CudaBackend(
                graph_memory_budget=graph_memory_budget,
                graph_memory_strategy=graph_memory_strategy,
                graph_memory_prefetch=graph_memory_prefetch,
            )
        elif graph_memory_budget is not None or graph_memory_strategy != "auto" or not graph_memory_prefetch:
            raise ValueError(
                "graph_memory_budget/graph_memory_strategy/graph_memory_prefetch configure the default CUDA backend; "
                "with your own backend, pass them to it (CudaBackend(graph_memory_budget=..., ...))"
            )
        self.fn = fn
        self.buckets = buckets
        self.max_graphs = max_graphs
        self.clone_outputs = clone_outputs
        self.warmup = warmup
        self.config = config
        self.name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        self.stats = GraphStats()
        self._backend = backend
        self._entries: dict[GraphKey, _Entry] = {}
        self._arena = PlaceholderArena()
        self._lanes = Lanes(self._arena)
        self._predictor = ZeroCopyPredictor(self._lanes, self.stats)
        self._carry = CarryPlan(self._lanes, self.stats)
        self._generation = Generation()
        self._keys: dict[Any, tuple[GraphKey | Unkeyable, list[int]]] = {}
        self._warned: set[Fallback] = set()
        self._grad = GradPolicy(fn)
        self._positions = parameter_positions(fn) if buckets is not None else {}
        unavailable = backend.unavailable()
        if config.disable_graphs:
            unavailable = (Fallback.GRAPHS_DISABLED, "TENDRIL_NO_GRAPHS is set")
        self._unavailable = unavailable

    def __repr__(self) -> str:
        return f"GraphedCallable({self.name}, graphs={len(self._entries)}/{self.max_graphs})"

    def keys(self) -> list[GraphKey]:
        """Keys with a captured graph, in capture order."""
        return list(self._entries)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        predictor = self._predictor
        if not predictor.active:
            return self._call(args, kwargs)
        lifted = predictor.enter_call()
        try:
            return self._call(args, kwargs)
        finally:
            predictor.exit_call(lifted)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.stats.calls += 1
        if self._unavailable is not None:
            return self._eager(args, kwargs, *self._unavailable)
        needs_autograd = self._grad.needs_autograd(args, kwargs)
        if needs_autograd is not None:
            detail = f"{needs_autograd}; call under torch.no_grad()/inference_mode() to graph it"
            return self._eager(args, kwargs, Fallback.REQUIRES_GRAD, detail)
        padded = self.buckets.pad(args, kwargs, self._positions) if self.buckets is not None else None
        flat = flatten_call(padded.args, padded.kwargs) if padded is not None else flatten_call(args, kwargs)
        key, indices = self._key(flat)
        if self._lanes.active and isinstance(key, GraphKey):
            key = self._lanes.key_for(key, flat, indices, self.stats)
        entry = self._entries.get(key) if isinstance(key, GraphKey) else None
        if entry is None:
            admitted = self._admit(key, flat)
            if not isinstance(admitted, _Entry):
                return self._eager(args, kwargs, *admitted)
            entry = admitted
        if padded is not None:
            self.stats.padded_calls += 1
        outputs = self._replay(entry, flat)
        if padded is not None:
            outputs = padded.restore(outputs)
        if self.clone_outputs:
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
        pending: dict[GraphKey, Flattened] = {}
        for example in examples:
            args, kwargs = _as_call(example)
            padded = self.buckets.pad(args, kwargs, self._positions) if self.buckets is not None else None
            if padded is not None:
                args, kwargs = padded.args, padded.kwargs
            flat = flatten_call(args, kwargs)
            key = key_of(flat)
            if isinstance(key, GraphKey) and key not in self._entries:
                pending.setdefault(key, flat)
            elif isinstance(key, Unkeyable):
                self._note(Fallback.UNKEYABLE, key.reason)
        if self._unavailable is not None:
            if pending:
                self._note(*self._unavailable)
            return 0
        order = sorted(pending.items(), key=lambda item: item[0].nbytes, reverse=True)
        for key, flat in order:
            for index, spec in zip(flat.tensor_indices(), key.tensors, strict=True):
                if self._backend.accepts(spec.device):
                    self._arena.reserve(index, spec)
        before = len(self._entries)
        for key, flat in _progress(order, self.name, progress):
            admitted = self._admit(key, flat)
            if not isinstance(admitted, _Entry):
                self._note(*admitted)
        return len(self._entries) - before

    def static_inputs(self, *args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The placeholders of this call's graph (captured if needed) in the call's structure.

        Writing inputs straight into them and calling `fast(*args, **kwargs)` with them skips the copy.
        """
        padded = self.buckets.pad(args, kwargs, self._positions) if self.buckets is not None else None
        if padded is not None:
            args, kwargs = padded.args, padded.kwargs
        flat = flatten_call(args, kwargs)
        key = key_of(flat)
        entry = self._entries.get(key) if isinstance(key, GraphKey) else None
        if entry is None:
            if self._unavailable is not None:
                raise RuntimeError(f"{self.name} cannot capture graphs: {self._unavailable[1]}")
            admitted = self._admit(key, flat)
            if not isinstance(admitted, _Entry):
                raise RuntimeError(f"{self.name} cannot graph this call: {admitted[0].value}: {admitted[1]}")
            entry = admitted
        leaves = list(flat.leaves)
        for index, placeholder in zip(entry.leaf_indices, entry.placeholders, strict=True):
            leaves[index] = placeholder
        return flat.unflatten(leaves)

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
        result (see `tendril.graphs.alias`).
        """
        self._lanes.active = True
        self._predictor.active += 1
        try:
            with ZeroCopyMode(self._predictor):
                yield
        finally:
            self._predictor.active -= 1
            self._predictor.end_interval(count=False)

    def carry(self, output: int | str | tuple[int | str, ...], input: int | str) -> GraphedCallable:
        """Declare loop-carried state: the tensors at `output` of call t are the argument `input` of call t+1.

        `output` indexes the function's result (an index or key, or a tuple of them for nested results);
        `input` is a positional index or a keyword name; both sides may be containers of tensors (a KV
        cache), matched leaf by leaf. Graphs then write those outputs straight into the next call's
        placeholders (double-buffered, see `tendril.graphs.carry`), so passing them back copies nothing.
        Declare carries before the first call; returns the callable.
        """
        if self._entries:
            raise RuntimeError(
                f"{self.name}: declare carry(...) before the first call or capture (graphs already captured "
                "would not write the carried outputs where the next call reads them)"
            )
        self._carry.declare(output, input)
        return self

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
        devices = key.devices()
        refused = sorted(str(device) for device in devices if not self._backend.accepts(device))
        if refused:
            return Fallback.CPU_TENSOR, f"tensor arguments on {', '.join(refused)}"
        if len(devices) > 1:
            return Fallback.MIXED_DEVICES, f"tensor arguments on {', '.join(sorted(map(str, devices)))}"
        if len(self._entries) >= self.max_graphs:
            return Fallback.LIMIT, f"{len(self._entries)} graphs captured, max_graphs={self.max_graphs}"
        return None

    def _admit(self, key: GraphKey | Unkeyable, flat: Flattened) -> _Entry | tuple[Fallback, str]:
        refusal = self._refusal(key)
        if refusal is not None:
            return refusal
        assert isinstance(key, GraphKey)
        indices = flat.tensor_indices()
        lane = lane_of(key)
        placeholders = [
            self._lanes.placeholder(lane, index, spec, flat.leaves[index])
            for index, spec in zip(indices, key.tensors, strict=True)
        ]
        key = self._lanes.current(key)  # a placeholder that outgrew its lane buffer reallocated it
        leaves = list(flat.leaves)
        for index, placeholder in zip(indices, placeholders, strict=True):
            leaves[index] = placeholder
        args, kwargs = flat.unflatten(leaves)
        versions = [placeholder._version for placeholder in placeholders]
        fn = _no_grad(self.fn)
        if self._carry.carries:
            fn = self._carry.prepare(fn, args, kwargs, key, indices, placeholders)
        try:
            captured = self._backend.capture(fn, args, kwargs, key, self.warmup)
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
        captured.outputs = self._carry.rebind(key, captured.outputs)
        self._lanes.pin_aliased_outputs(indices, placeholders, captured.outputs)
        entry = _Entry(key, indices, placeholders, captured, record, Staging.of(indices, placeholders))
        self._entries[key] = entry
        self.stats.graphs[key] = record
        self._sync_memory_stats()
        return entry

    # -- execution -----------------------------------------------------------------------------------

    def _replay(self, entry: _Entry, flat: Flattened) -> Any:
        if entry.captured.before_inputs is not None:
            entry.captured.before_inputs()
        predictor = self._predictor if self._predictor.active else None
        stage_inputs(entry.staging, flat.leaves, self.stats, predictor)
        if self._carry.carries:
            self.stats.input_bytes_copied += self._carry.in_graph_bytes.get(entry.key, 0)
        self._generation.value += 1
        entry.captured.replay()
        entry.record.replays += 1
        self.stats.replays += 1
        return entry.captured.outputs

    def _eager(self, args: tuple[Any, ...], kwargs: dict[str, Any], reason: Fallback, detail: str) -> Any:
        self.stats.record_fallback(reason, detail)
        self._warn_once(reason, detail)
        return self.fn(*args, **kwargs)

    def _note(self, reason: Fallback, detail: str) -> None:
        """Record a reason found while capturing ahead of time (no call ran eagerly)."""
        self.stats.fallback_details.setdefault(reason, detail)
        self._warn_once(reason, detail)

    def _warn_once(self, reason: Fallback, detail: str) -> None:
        if reason in self._warned:
            return
        self._warned.add(reason)
        warnings.warn(
            f"tendril.graphed({self.name}) runs eagerly: {reason.value} ({detail}). Later occurrences are "
            "counted in .stats.fallbacks without warning.",
            GraphFallbackWarning,
            stacklevel=4,
        )

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
    backend: Backend | None = None,
    config: Config | None = None,
    graph_memory_budget: int | str | None = None,
    graph_memory_strategy: str = "auto",
    graph_memory_prefetch: bool = True,
) -> GraphedCallable:
    """Run `fn` (an `nn.Module` or any function of tensors) as CUDA graphs keyed by its argument shapes.

    `buckets` pads calls up to declared sizes (see `tendril.graphs.buckets.sequence_buckets`);
    `max_graphs` bounds the number of graphs (new keys past it run eagerly); `clone_outputs=True`
    returns copies instead of views of graph memory (which the next call overwrites); `warmup` eager
    runs precede each capture. `backend` defaults to CUDA (`NullBackend` simulates it for tests).
    Without CUDA every call runs eagerly, with one warning.

    `graph_memory_budget` ("256MiB", or bytes) bounds the device memory the driver holds for the graphs'
    executables; under it, captured graphs stay on the host and executables are instantiated on demand and
    evicted least recently used first, with results identical to one executable per graph.
    `graph_memory_strategy` overrides the choice: "auto" (dedicated executables without a budget, "update"
    with one), "dedicated", "lru" or "update" (as "lru" until the budget is full, then a miss switches an
    executable of the graph's topology family by `cudaGraphExecUpdate`; see `tendril.graphs.executables`).
    Under "lru" and "update" the executable of the call predicted next (lengths stepping by a constant amount, as
    in a generation loop) is made ahead on a background thread (instantiated, or under "update" at a full budget
    switched); `graph_memory_prefetch=False` turns that off.
    """
    return GraphedCallable(
        fn,
        buckets=buckets,
        max_graphs=max_graphs,
        clone_outputs=clone_outputs,
        warmup=warmup,
        backend=backend,
        config=config,
        graph_memory_budget=graph_memory_budget,
        graph_memory_strategy=graph_memory_strategy,
        graph_memory_prefetch=graph_memory_prefetch,
    )


def _no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    return run


def _as_call(example: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example, Call):
        return tuple(example.args), dict(example.kwargs or {})
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, dict):
        return (), dict(example)
    if isinstance(example, Sequence):
        return tuple(example), {}
    raise TypeError(
        f"capture example of type {type(example).__name__}: expected a tuple of arguments, a dict of keyword "
        "arguments, a tendril.graphs.Call or a tensor"
    )


def _progress(items: list[Any], name: str, show: bool) -> Iterable[Any]:
    if not show:
        return items
    from rich.progress import track

    return track(items, description=f"capturing {len(items)} graphs of {name}", transient=True)
