"""`tendril.graphed_step`: whole training steps (forward, loss, backward, optimizer step) as shape-keyed CUDA graphs.

    step = tendril.graphed_step(train_step, model=model, optimizer=opt, buckets=...)
    for batch in loader:
        loss = step(*batch)

where `train_step(*batch)` does the forward pass, the loss, `loss.backward()`, the optimizer step (through the
scaler under AMP) and `optimizer.zero_grad(set_to_none=False)`, and returns the loss. Calls are keyed as
`tendril.graphed` keys them (tensor shapes and dtypes, other arguments' values; plus the training modes of the model
and of its mode-dependent layers: `model.eval()`, or batch norm frozen alone, selects other graphs), padded to
`buckets` first, and every graph is captured into one pool shared by all keys (`CudaBackend`).

Exactly one step per call. At a key without a graph:

1. the first call runs the step eagerly as the graph will record it (its stream, its attention kernels): a real step
   that also makes the optimizer state, on the very first step, warms the shapes' kernels and workspaces, and
   compiles what `torch.compile` wraps (no mode is active, so that nothing compiled is left for the capture).
   Until the optimizer has its state (a first step the grad scaler skipped makes none), the next call warms again;
2. the next call captures the step into the key's graph, which records the step without running it, then replays
   the graph once: that replay is the call's step. A capture that fails (`Fallback.HOST_SYNC`, or another error,
   `CAPTURE_ERROR`) runs the call's step eagerly. The key's next call captures once more, since that eager step
   may have finished a one-time setup the capture tripped over (`torch.compile` recompiling for the capture and
   benchmarking the new kernels, which synchronises); a second failure runs the key eagerly from then on. With
   `check_syncs`, the first eager step after the second failure runs under `find_host_syncs`: the syncs it finds,
   with their places, go to `stats.host_syncs` and the reason's detail. They are a diagnosis, not a verdict: some
   code reads a value only when no capture is running (HF's attention-mask checks skip `mask.all()` while a CUDA
   stream captures), so the capture is the judge;
3. later calls copy their tensors into the key's placeholders and replay.

`capture(examples)` takes keys through rules 1 and 2 ahead of time, largest first so that smaller graphs reuse the
largest one's memory, and undoes rule 1's step: no training happens there.

The invariants the graphs rely on (fixed gradient and state addresses, capturable optimizers and scalers, settings
baked into the graphs) are checked by `invariants` and `scaler`; the model's tensors must stay the ones they were,
where they were (`module_state`), or the next call that may graph raises. Random numbers (dropout) draw fresh values
at every replay, see `tendril.graphs.training`.

Gradient accumulation: with `accumulate=N`, `fn` only accumulates (forward, loss divided by N, backward; no
optimizer step, no zero_grad) and every Nth call also runs the optimizer update, made here: `scaler.step(optimizer)`
and `scaler.update()` (or `optimizer.step()`), then `optimizer.zero_grad(set_to_none=False)`, graphed as a key of
its own in the same pool.

Calls that run eagerly (no CUDA, `TENDRIL_NO_GRAPHS`, unkeyable arguments, `max_graphs` reached, a failed key) are
counted in `stats.fallbacks` with their reason and warned once per reason; they run `fn` on the call's own
(unpadded) arguments. Warm-up calls (rule 1) are counted in `stats.warmup_steps`, not as fallbacks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from tendril.config import Config
from tendril.graphs.admission import FallbackWarnings, graphs_unavailable, placement_refusal
from tendril.graphs.backend import Backend, Captured, CaptureFailed
from tendril.graphs.buckets import Buckets, parameter_positions
from tendril.graphs.examples import as_call
from tendril.graphs.key import Flattened, GraphKey, Unkeyable, flatten_call, key_of
from tendril.graphs.memory import PlaceholderArena
from tendril.graphs.module_state import ModuleState
from tendril.graphs.options import DEFAULT_MAX_GRAPHS, GraphMemoryPolicy
from tendril.graphs.outputs import clone_outputs
from tendril.graphs.stats import Fallback, GraphRecord, GraphStats
from tendril.graphs.syncs import find_host_syncs
from tendril.graphs.training import invariants
from tendril.graphs.training.layerdrop import HostLayerDropWarning, host_layerdrop
from tendril.graphs.training.scaler import check_scaler, reset_after_failed_capture
from tendril.graphs.training.simulated import Recording, runs_on_capture
from tendril.utils.checks import is_integer

STEP = "step"
UPDATE = "optimizer update"
"""The two kinds of graphed work: the step function, and (with `accumulate`) the optimizer update."""


@dataclass
class StepStats(GraphStats):
    """`GraphStats` of a graphed step, with the eager calls that warm a key before its capture."""

    warmup_steps: int = 0
    """Calls run eagerly by design, as the first call at a key (see the module docstring), not as fallbacks."""
    optimizer_updates: int = 0
    """Optimizer updates made by `accumulate` (every Nth call)."""
    host_syncs: dict[GraphKey, str] = dataclasses.field(default_factory=dict)
    """Per key whose capture failed, what `find_host_syncs` reported on its first eager step, where it found any."""
    host_layerdrop: list[str] = dataclasses.field(default_factory=list)
    """The model's modules whose LayerDrop draws on the host, which graphs freeze (`layerdrop.host_layerdrop`)."""


@dataclass
class _Graph:
    key: GraphKey
    positions: list[int]
    placeholders: list[torch.Tensor]
    captured: Captured
    record: GraphRecord


class GraphedStep:
    """A training step run as shape-keyed CUDA graphs sharing one pool. Create with `tendril.graphed_step`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scaler: Any,
        buckets: Buckets | None,
        accumulate: int | None,
        max_graphs: int,
        check_syncs: bool,
        clone_loss: bool,
        backend: Backend,
        config: Config,
    ) -> None:
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer is not None:
            invariants.check_optimizer(optimizer)
        check_scaler(scaler, optimizer)
        if accumulate is not None and (not is_integer(accumulate) or accumulate < 1):
            raise ValueError(f"accumulate must be a positive int (micro-batches per update), got {accumulate!r}")
        if accumulate is not None and optimizer is None:
            raise ValueError("accumulate= needs optimizer=: every Nth call runs the optimizer update")
        if buckets is not None and not isinstance(buckets, Buckets):
            raise TypeError(f"buckets must be a tendril.Buckets, got {type(buckets).__name__}")
        if not is_integer(max_graphs) or max_graphs < 0:
            raise ValueError(f"max_graphs must be an integer >= 0, got {max_graphs!r}")
        self.fn = fn
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.buckets = buckets
        self.accumulate = accumulate
        self.max_graphs = max_graphs
        self.check_syncs = check_syncs
        self.clone_loss = clone_loss
        self.name = getattr(fn, "__qualname__", None) or type(fn).__name__
        self.stats = StepStats()
        self._parameters = invariants.trained_parameters(model, optimizer)
        if not self._parameters:
            raise ValueError("model has no parameter that requires grad: nothing to train")
        invariants.allocate_grads(self._parameters)
        self._addresses = invariants.AddressBook(self._parameters)
        self._modules = ModuleState([model])
        self._state_recorded = False
        self._hyperparameters: tuple[Any, ...] | None = None
        from tendril.graphs.cuda_backend import CudaBackend

        self._on_cuda = isinstance(backend, CudaBackend)
        self._attention = backend.sdpa_backends if isinstance(backend, CudaBackend) else None
        self._backend: Backend = Recording(backend, self._training_state) if runs_on_capture(backend) else backend
        self._positions = parameter_positions(fn) if buckets is not None else {}
        self._arena = PlaceholderArena()
        self._graphs: dict[GraphKey, _Graph] = {}
        self._warmed: set[GraphKey] = set()
        self._diagnosed: set[GraphKey] = set()
        self._failed_once: set[GraphKey] = set()
        self._warnings = FallbackWarnings(f"tendril.graphed_step({self.name})")
        self._pending = 0
        self._unavailable = graphs_unavailable(backend, config)
        self.stats.host_layerdrop = host_layerdrop(model)
        if self.stats.host_layerdrop:
            warnings.warn(
                f"tendril.graphed_step({self.name}): LayerDrop in {', '.join(self.stats.host_layerdrop)} is decided "
                "on the host, so each graph would skip the layers skipped while it was captured, at every step; call "
                "tendril.graphs.training.layerdrop_on_device(model) first, which draws on the device",
                HostLayerDropWarning,
                stacklevel=3,
            )

    def __repr__(self) -> str:
        return f"GraphedStep({self.name}, graphs={len(self._graphs)}/{self.max_graphs})"

    def keys(self) -> list[GraphKey]:
        """Keys with a captured graph, in capture order."""
        return list(self._graphs)

    def capture(self, examples: Iterable[Any]) -> int:
        """Capture graphs ahead of time for `examples`, largest first, without training on them; return how many
        new graphs there are.

        Each example is a batch as the step takes it (a tuple of positional arguments, a dict of keyword
        arguments, a `Call` or a single tensor), padded to its bucket as a call is. A key's warm-up step (rule 1)
        runs on the example and is then undone: parameters, gradients, optimizer and scaler state are put back
        from a copy held meanwhile (random generators stay advanced). Largest first lets every smaller graph
        reuse the largest one's memory in the shared pool, which captures in call order, growing, cannot. The
        optimizer needs its state (take one step first): a first step's state has nothing to be put back to.
        Examples that cannot be graphed are recorded in `stats`."""
        if self.optimizer is not None and not invariants.optimizer_ready(self.optimizer):
            raise RuntimeError("capture() needs the optimizer's state: call the graphed step once first")
        pending: dict[GraphKey, Flattened] = {}
        for example in examples:
            args, kwargs = as_call(example)
            padded = self.buckets.pad(args, kwargs, self._positions) if self.buckets else None
            flat = flatten_call(*((padded.args, padded.kwargs) if padded is not None else (args, kwargs)))
            key = key_of(flat)
            if isinstance(key, Unkeyable):
                self._note(Fallback.UNKEYABLE, key.reason)
                continue
            key = self._keyed(STEP, key)
            if key not in self._graphs:
                pending.setdefault(key, flat)
        if self._unavailable is not None:
            if pending:
                self._note(*self._unavailable)
            return 0
        order = sorted(pending.items(), key=lambda item: item[0].nbytes, reverse=True)
        for key, flat in order:
            for index, spec in zip(flat.tensor_indices(), key.tensors, strict=True):
                self._arena.reserve(index, spec)
        before = len(self._graphs)
        for key, flat in order:
            refusal = self._refusal(key)
            if refusal is not None:
                self._note(*refusal)
                continue
            if key not in self._warmed:
                saved = [tensor.clone() for tensor in self._training_state()]
                self._warm(self.fn, *flat.unflatten(list(flat.leaves)), key)
                with torch.no_grad():
                    torch._foreach_copy_(self._training_state(), saved)
                del saved
            if key in self._warmed:
                captured = self._capture(self.fn, flat, key)
                if isinstance(captured, CaptureFailed):
                    self._note(captured.reason, captured.detail)
        return len(self._graphs) - before

    def _note(self, reason: Fallback, detail: str) -> None:
        """Record a reason found while capturing ahead of time (no call ran eagerly)."""
        self.stats.fallback_details.setdefault(reason, detail)
        self._warnings.warn(reason, detail)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.stats.calls += 1
        loss = self._run(STEP, self.fn, args, kwargs)
        if self.accumulate is not None:
            self._pending += 1
            if self._pending == self.accumulate:
                self._pending = 0
                self.stats.optimizer_updates += 1
                self._run(UPDATE, self._update, (), {})
        return loss

    def _update(self) -> None:
        """The optimizer update of `accumulate` mode (see the module docstring)."""
        assert self.optimizer is not None
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    # -- dispatch -------------------------------------------------------------------------------------

    def _run(self, kind: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._unavailable is not None:
            return self._eager(fn, args, kwargs, *self._unavailable)
        if not self._addresses.grads_in_place():
            self._addresses.verify(self.optimizer, self.scaler)
        if self._hyperparameters is not None:
            invariants.check_hyperparameters(self._hyperparameters, self.optimizer)
        padded = self.buckets.pad(args, kwargs, self._positions) if kind == STEP and self.buckets else None
        call_args, call_kwargs = (padded.args, padded.kwargs) if padded is not None else (args, kwargs)
        flat = flatten_call(call_args, call_kwargs)
        key = key_of(flat)
        if isinstance(key, Unkeyable):
            return self._eager(fn, args, kwargs, Fallback.UNKEYABLE, key.reason)
        key = self._keyed(kind, key)
        graph = self._graphs.get(key)
        if graph is not None:
            if padded is not None:
                self.stats.padded_calls += 1
            return self._replay(graph, flat)
        refusal = self._refusal(key)
        if refusal is not None:
            return self._eager(fn, args, kwargs, *refusal, failed_key=key if key in self.stats.failed_keys else None)
        if key not in self._warmed:
            return self._warm(fn, call_args, call_kwargs, key)
        if padded is not None:
            self.stats.padded_calls += 1
        return self._capture_and_replay(fn, flat, key, (args, kwargs))

    def _keyed(self, kind: str, key: GraphKey) -> GraphKey:
        """`key` for a `kind` call (a step or an update) in the modules' current modes, once the model's tensors are
        checked to be the ones the step was made over (module docstring)."""
        invariants.check_model_tensors(self._modules, f"tendril.graphed_step({self.name})")
        return dataclasses.replace(key, structure=(kind, self._modules.modes(), key.structure))

    def _refusal(self, key: GraphKey) -> tuple[Fallback, str] | None:
        """Why a key without a graph runs eagerly, or None if it may be warmed and captured."""
        failed = self.stats.failed_keys.get(key)
        if failed is not None:
            return failed, f"the key {key} failed before: {self.stats.fallback_details.get(failed, '')}"
        return placement_refusal(key, self._backend, len(self._graphs), self.max_graphs)

    def _warm(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], key: GraphKey) -> Any:
        """Rule 1: the call's step, eagerly, on the capture stream. The key is captured at its next call once the
        optimizer has its state (a first step that the scaler skipped made none, and the next warms again)."""
        self.stats.warmup_steps += 1
        with self._capture_stream(key):
            result = fn(*args, **kwargs)
        self._after_eager()
        if invariants.optimizer_ready(self.optimizer):
            self._warmed.add(key)
        return result

    def _capture_and_replay(
        self, fn: Callable[..., Any], flat: Flattened, key: GraphKey, call: tuple[tuple[Any, ...], dict[str, Any]]
    ) -> Any:
        """Rule 2: capture (records, runs nothing), then replay once: the call's step. A failed capture runs the
        call's step eagerly, with the reason."""
        graph = self._capture(fn, flat, key)
        if isinstance(graph, CaptureFailed):
            if key not in self.stats.failed_keys:
                return self._eager(fn, *call, graph.reason, graph.detail, retried=True)
            return self._eager(fn, *call, graph.reason, graph.detail, failed_key=key)
        return self._replay(graph, flat)

    def _capture(self, fn: Callable[..., Any], flat: Flattened, key: GraphKey) -> _Graph | CaptureFailed:
        """Capture `key`'s graph on placeholders holding the call's tensors (so that a backend whose capture runs
        the function, `NullBackend`, reads real values, indices in range, rather than uninitialised memory)."""
        positions = flat.tensor_indices()
        placeholders = [
            self._arena.placeholder(i, spec, flat.leaves[i]) for i, spec in zip(positions, key.tensors, strict=True)
        ]
        leaves = list(flat.leaves)
        for index, placeholder in zip(positions, placeholders, strict=True):
            leaves[index] = placeholder
        args, kwargs = flat.unflatten(leaves)
        try:
            captured = self._backend.capture(fn, args, kwargs, key, 0)
        except CaptureFailed as failure:
            reset_after_failed_capture(self.scaler)
            if key in self._failed_once:
                self.stats.failed_keys[key] = failure.reason
            self._failed_once.add(key)
            self.stats.pool_bytes = self._backend.pool_bytes()
            return failure
        self._addresses.verify(self.optimizer, self.scaler)
        record = GraphRecord(key, captured.capture_ms, captured.pool_growth_bytes, captured.driver_bytes)
        record.phases_ms = captured.phases_ms
        if captured.memory is not None:
            record.memory = captured.memory
        graph = _Graph(key, positions, placeholders, captured, record)
        self._graphs[key] = graph
        self.stats.graphs[key] = record
        self.stats.pool_bytes = self._backend.pool_bytes()
        self.stats.placeholder_bytes = self._arena.nbytes
        if self._hyperparameters is None:
            self._hyperparameters = invariants.hyperparameters(self.optimizer)
        return graph

    def _replay(self, graph: _Graph, flat: Flattened) -> Any:
        """Rule 3: copy the call's tensors into the placeholders, replay."""
        captured = graph.captured
        if captured.before_inputs is not None:
            captured.before_inputs()
        sources = [flat.leaves[i] for i in graph.positions]
        copies = [(p, s) for p, s in zip(graph.placeholders, sources, strict=True) if p is not s]
        if copies:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in copies], [s for _, s in copies])
            self.stats.input_copies += len(copies)
            self.stats.input_bytes_copied += sum(s.numel() * s.element_size() for _, s in copies)
        captured.replay()
        graph.record.replays += 1
        self.stats.replays += 1
        return clone_outputs(captured.outputs) if self.clone_loss else captured.outputs

    def _eager(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        reason: Fallback,
        detail: str,
        failed_key: GraphKey | None = None,
        retried: bool = False,
    ) -> Any:
        """The call's step, eagerly, recorded as a fallback and warned once per reason. After a key's first failed
        capture (`retried`: its next call captures again) there is no warning yet. The first eager step at a
        `failed_key` (a key whose capture failed twice) runs under `find_host_syncs` when `check_syncs`, and its
        findings join the reason's detail (rule 2)."""
        report = None
        if failed_key is not None and self.check_syncs and failed_key not in self._diagnosed:
            self._diagnosed.add(failed_key)
            results: list[Any] = []
            report = find_host_syncs(lambda *a, **k: results.append(fn(*a, **k)), *args, **kwargs)
            result = results[0]
        else:
            result = fn(*args, **kwargs)
        self.stats.record_fallback(reason, detail)
        if report and failed_key is not None:
            self.stats.host_syncs[failed_key] = str(report)
            detail = f"{detail}; its eager step found {report}"
            self.stats.fallback_details[reason] = detail  # replaces the detail the retried step recorded first
        if not retried:
            self._warnings.warn(reason, detail)
        self._after_eager()
        return result

    def _after_eager(self) -> None:
        """Check the gradients and state kept their addresses; remember the state once the optimizer has made it."""
        self._addresses.verify(self.optimizer, self.scaler)
        if not self._state_recorded and invariants.optimizer_ready(self.optimizer):
            self._addresses.record_state(self.optimizer, self.scaler)
            self._state_recorded = True

    def _training_state(self) -> list[torch.Tensor]:
        """Every tensor a step writes: parameters, gradients, optimizer and scaler state (for `Recording`)."""
        tensors = [p.data for p in self._parameters]
        tensors += [p.grad for p in self._parameters if p.grad is not None]
        return tensors + list(invariants.state_tensors(self.optimizer, self.scaler).values())

    @contextlib.contextmanager
    def _capture_stream(self, key: GraphKey) -> Iterator[None]:
        """On CUDA, run the block as captures run: on their stream (warming its workspaces), ordered with the current
        one, with their attention kernels."""
        if not self._on_cuda:
            yield
            return
        from tendril.graphs.capture import capture_stream

        device = next(iter(key.devices()), None) or torch.device("cuda", torch.cuda.current_device())
        stream = capture_stream(device)
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        attention = sdpa_kernel(list(self._attention)) if self._attention is not None else contextlib.nullcontext()
        with torch.cuda.stream(stream), attention:
            yield
        current.wait_stream(stream)



def graphed_step(
    fn: Callable[..., Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    buckets: Buckets | None = None,
    accumulate: int | None = None,
    memory: GraphMemoryPolicy | int | str | None = None,
    max_graphs: int = DEFAULT_MAX_GRAPHS,
    check_syncs: bool = True,
    clone_loss: bool = True,
    backend: Backend | None = None,
    config: Config | None = None,
) -> GraphedStep:
    """Run the training step `fn(*batch)` (forward, loss, backward, optimizer step, zero_grad; returns the loss) as
    CUDA graphs keyed by the batch's shapes, one per bucket, in one shared pool (see the module docstring).

    `model`: the trained module (its parameters get their `.grad` allocated now; its `training` flag is part of the
    key). `optimizer`: capturable (`capturable=True`, or SGD), else `ValueError`. `scaler`: a
    `torch.amp.GradScaler` with a fused optimizer, or a `tendril.DeviceGradScaler`. `buckets`: pad the batch up to
    declared lengths (the step must ignore padded positions: labels -100, a zero attention mask). `accumulate=N`:
    `fn` only accumulates and every Nth call runs the optimizer update. `memory`: the graph-memory policy of the
    default CUDA backend (as `tendril.graphed`). `check_syncs`: run the first eager step at a key whose capture
    failed under `find_host_syncs`, which names the host syncs and their lines. `clone_loss`: return a copy of the
    loss (False: a view of graph memory, overwritten by the next call).
    """
    if config is None:
        from tendril.config import settings

        config = settings
    if backend is None:
        from tendril.graphs.cuda_backend import CudaBackend

        backend = CudaBackend(memory=GraphMemoryPolicy.of(memory))
    elif memory is not None:
        raise ValueError("memory= configures the default CUDA backend; with your own backend, pass it there")
    return GraphedStep(
        fn,
        model=model,
        optimizer=optimizer,
        scaler=scaler,
        buckets=buckets,
        accumulate=accumulate,
        max_graphs=max_graphs,
        check_syncs=check_syncs,
        clone_loss=clone_loss,
        backend=backend,
        config=config,
    )
