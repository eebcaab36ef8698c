"""Seeded differential fuzzing of `tendril.graphed` against eager PyTorch.

`draw_case(seed)` draws a `Case` (a model, a dtype, buckets or none, a graph-memory budget or none, zero-copy
or not, debug mode or not, a graph limit, a call order of lengths with repeats); `run_case(case, device)`
builds the model, runs the call order graphed and eagerly under `torch.inference_mode()`, and returns an
`Outcome`. The checks, per call and per case:

- every graphed output equals eager (fp32: tight; fp16/bf16: looser, elementwise and in relative norm);
- returned outputs are then poisoned with NaN, so a later call that does not rewrite them fails the comparison;
- in debug mode a use of the previous call's output after a replay raises `StaleOutputError`;
- capture counts: one graph per distinct key (a bucket, or the exact length), replays for the rest, eager calls
  past `max_graphs` only;
- on CUDA, `torch.cuda.memory_allocated()` is back to its baseline once the callable and its outputs are gone.

On the CPU the callable runs on `NullBackend` (simulated graphs), where a memory budget does not apply.
Draws do not depend on the machine: a model whose library is missing (torchvision) is skipped, not redrawn.
"""

from __future__ import annotations

import contextlib
import gc
import random
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

import tendril
from tendril.config import Config
from tendril.graphs.backend import Backend, NullBackend
from tendril.graphs.callable import DEFAULT_MAX_GRAPHS, GraphedCallable
from tendril.graphs.outputs import StaleOutputError
from tendril.graphs.stats import Fallback
from tests.fuzz import models
from tests.fuzz.models import ModelUnavailable, Structure

DTYPES = (torch.float32, torch.float32, torch.float16, torch.bfloat16)
BUCKET_SIZES = (8, 16, 24, 32, 48, 64)
BUDGETS = ("1MiB", "4MiB", "64MiB")
LEAK_TOLERANCE_BYTES = 1 << 20
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-2, 2e-2), torch.bfloat16: (1.5e-1, 6e-2)}
"""(elementwise atol = rtol, relative norm of the difference) per dtype."""


class Mismatch(AssertionError):
    """The graphed callable disagreed with eager, or broke a rule of its contract."""


@dataclass(frozen=True)
class Case:
    seed: int
    model: str
    structure: Structure
    dtype: torch.dtype
    batch: int
    lengths: tuple[int, ...]
    buckets: tuple[int, ...] | None = None
    budget: str | None = None
    zero_copy: bool = False
    debug: bool = False
    clone_outputs: bool = False
    max_graphs: int = DEFAULT_MAX_GRAPHS

    def repro(self, device: str) -> str:
        """One line that reruns this case and raises on its failure."""
        return (f'PYTHONPATH=src:. python -c "from tests.fuzz.cases import replay; replay({self.seed}, '
                f"'{device}')\"")

    def describe(self) -> str:
        options = [f"buckets={self.buckets}" if self.buckets else "", f"budget={self.budget}" if self.budget else "",
                   "zero_copy" if self.zero_copy else "", "debug" if self.debug else "",
                   "clone_outputs" if self.clone_outputs else "",
                   f"max_graphs={self.max_graphs}" if self.max_graphs != DEFAULT_MAX_GRAPHS else ""]
        return (f"{self.model} {self.structure} {str(self.dtype).removeprefix('torch.')} batch={self.batch} "
                f"lengths={list(self.lengths)} {' '.join(o for o in options if o)}").strip()


@dataclass
class Outcome:
    case: Case
    device: str
    status: str = "ok"
    """ok, mismatch, crash (an unexpected exception) or skipped."""
    detail: str = ""
    leaked_bytes: int = 0
    calls: int = 0

    @property
    def failed(self) -> bool:
        return self.status in ("mismatch", "crash")

    def message(self) -> str:
        return (f"seed {self.case.seed} {self.status}: {self.detail}\n  case: {self.case.describe()}\n"
                f"  reproduce: {self.case.repro(self.device)}\n"
                f"  or: TENDRIL_FUZZ_GPU_SEEDS={self.case.seed + 1} PYTHONPATH=src python -m pytest "
                f"tests/fuzz/test_differential.py "
                f'-k "{self.device}_seed_{self.case.seed}"')


def draw_case(seed: int) -> Case:
    """The case of `seed`: the same on every machine."""
    rng = random.Random(seed)
    name = rng.choice(models.ALL_MODELS)
    if name in models.RANDOM_MODELS:
        structure = Structure(hidden=rng.choice((16, 32, 64)), depth=rng.randint(2, 4),
                              activation=rng.choice(("gelu", "relu", "tanh")))
    elif name in models.VISION_MODELS:
        structure = Structure()
    else:
        structure = Structure(hidden=rng.choice((32, 48, 64)))
    low, high = models.lengths_for(name)
    pool = rng.sample(range(low, high + 1), k=rng.randint(1, 4))
    lengths = tuple(rng.choice(pool) for _ in range(rng.randint(3, 8)))
    buckets = None
    if name in models.TOKEN_MODELS and rng.random() < 0.4:
        buckets = tuple(sorted(rng.sample(BUCKET_SIZES, k=rng.randint(1, 3))))
    return Case(
        seed=seed,
        model=name,
        structure=structure,
        dtype=rng.choice(DTYPES),
        batch=rng.choice((1, 1, 2)) if name != "mlp_branches" else 1,
        lengths=lengths,
        buckets=buckets,
        budget=rng.choice(BUDGETS) if rng.random() < 0.3 else None,
        zero_copy=rng.random() < 0.25,
        debug=rng.random() < 0.25,
        clone_outputs=rng.random() < 0.15,
        max_graphs=rng.randint(1, 3) if rng.random() < 0.15 else DEFAULT_MAX_GRAPHS,
    )


def _graphed(fn: Callable[..., Any], budget: str | None, **options: Any) -> GraphedCallable:
    """`tendril.graphed(fn, **options)` with a graph-memory budget; a budget configures the CUDA backend only,
    so with another backend it is not passed."""
    if budget is not None and options.get("backend") is None:
        options["memory"] = budget
    return tendril.graphed(fn, **options)


def tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def compare(got: list[torch.Tensor], expected: list[torch.Tensor], dtype: torch.dtype, what: str) -> None:
    """Raise `Mismatch` unless `got` equals `expected` leaf by leaf within the dtype's tolerance."""
    if len(got) != len(expected):
        raise Mismatch(f"{what}: {len(got)} output tensors, eager returns {len(expected)}")
    close, norm = TOLERANCE.get(dtype, TOLERANCE[torch.float32])
    for index, (g, e) in enumerate(zip(got, expected, strict=True)):
        where = f"{what}, output {index}"
        if g.shape != e.shape or g.dtype != e.dtype:
            raise Mismatch(f"{where}: {g.dtype}{list(g.shape)}, eager {e.dtype}{list(e.shape)}")
        g = g.detach().as_subclass(torch.Tensor).cpu()
        e = e.cpu()
        if not g.is_floating_point():
            if not torch.equal(g, e):
                raise Mismatch(f"{where}: values differ from eager")
            continue
        g, e = g.float(), e.float()
        finite = torch.isfinite(e)
        if not torch.equal(torch.isfinite(g), finite):
            raise Mismatch(f"{where}: {int((~torch.isfinite(g) & finite).sum())} non-finite values where eager's "
                           "are finite (a NaN is a poisoned value the call did not rewrite)")
        g, e = g[finite], e[finite]
        relative = float((g - e).norm() / e.norm().clamp_min(1e-12))
        worst = float(((g - e).abs() - close * e.abs()).max()) if e.numel() else 0.0
        if relative > norm or worst > close:
            raise Mismatch(f"{where}: relative error {relative:.2e} (at most {norm:.0e}), worst element off by "
                           f"{worst + close:.2e}")


def _key(case: Case, length: int) -> int:
    """What the callable keys a call of `length` by: its bucket, or the length itself."""
    if case.buckets is not None:
        for size in case.buckets:
            if length <= size:
                return size
    return length


@dataclass
class _Run:
    """One case's callable and what the checks need to remember between calls."""

    case: Case
    fast: GraphedCallable
    stale: list[torch.Tensor] = field(default_factory=list)

    def call(self, index: int, argument: torch.Tensor, expected: list[torch.Tensor]) -> None:
        case, fast = self.case, self.fast
        replays = fast.stats.replays
        outputs = tensors(fast(argument.clone() if case.zero_copy else argument))
        replayed = fast.stats.replays > replays
        if replayed and self.stale:
            try:
                self.stale[0].sum()
            except StaleOutputError:
                pass
            else:
                raise Mismatch(f"call {index}: the previous call's output stayed usable after a replay in debug mode")
        self.stale = []
        compare(outputs, expected, case.dtype, f"call {index} (length {case.lengths[index]})")
        floating = [t for t in outputs if t.is_floating_point()]
        for tensor in floating:
            tensor.fill_(float("nan"))
        if case.debug and replayed and not case.clone_outputs and floating:
            self.stale = floating[:1]

    def check_counts(self, backend: Backend | None) -> None:
        case, stats = self.case, self.fast.stats
        calls = len(case.lengths)
        if stats.calls != calls or stats.replays + stats.eager_calls != calls:
            raise Mismatch(f"{calls} calls: stats count {stats.calls} calls, {stats.replays} replays and "
                           f"{stats.eager_calls} eager calls")
        keys = [_key(case, length) for length in case.lengths]
        admitted = list(dict.fromkeys(keys))[: case.max_graphs]
        failed = set(stats.failed_keys.values())
        if failed - {Fallback.HOST_SYNC}:
            raise Mismatch(f"captures failed: {stats.fallback_details}")
        if case.zero_copy:  # lanes capture a key once per lane and lane generation
            if len(stats.graphs) < min(len(admitted), case.max_graphs) or len(stats.graphs) > case.max_graphs:
                raise Mismatch(f"{len(stats.graphs)} graphs for {len(admitted)} distinct keys under zero-copy")
            return
        if failed:  # keys whose capture synchronised run eagerly; the others still capture once each
            if len(stats.graphs) > len(admitted):
                raise Mismatch(f"{len(stats.graphs)} graphs for {len(admitted)} admitted keys")
            return
        replays = sum(key in admitted for key in keys)
        if len(stats.graphs) != len(admitted) or stats.replays != replays:
            raise Mismatch(f"keys {keys} (max_graphs={case.max_graphs}): expected {len(admitted)} captures and "
                           f"{replays} replays, got {len(stats.graphs)} and {stats.replays}")
        if isinstance(backend, NullBackend) and backend.captures != len(admitted):
            raise Mismatch(f"the backend captured {backend.captures} graphs, expected {len(admitted)}")


def _execute(case: Case, device: str, backend: Backend | None) -> None:
    model = models.build(case.model, case.structure, case.dtype, device)
    generator = torch.Generator().manual_seed(case.seed)
    inputs = [models.make_input(case.model, case.structure, length, case.batch, case.dtype, device, generator)
              for length in case.lengths]
    expected = [[t.clone() for t in tensors(model(x))] for x in inputs]
    buckets = tendril.sequence_buckets(case.buckets) if case.buckets is not None else None
    fast = _graphed(model, case.budget, buckets=buckets, max_graphs=case.max_graphs,
                    clone_outputs=case.clone_outputs, backend=backend, config=Config(debug=case.debug))
    run = _Run(case, fast)
    with fast.zero_copy() if case.zero_copy else contextlib.nullcontext():
        for index, (argument, wanted) in enumerate(zip(inputs, expected, strict=True)):
            run.call(index, argument, wanted)
    run.check_counts(backend)


def _allocated(device: str, collect: bool = False) -> int:
    """Device memory allocated now (0 on the CPU, where nothing is measured). A full garbage collection is
    slow in a process holding transformers, so it runs only when asked (`collect`)."""
    if device != "cuda":
        return 0
    if collect:
        gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _warm_streams(device: str) -> None:
    """Give the current stream (the eager reference's) and tendril's capture stream their cuBLAS and cuBLASLt
    workspaces (a product, and a linear layer with bias) before the baseline: PyTorch keeps them per stream for the
    process's life, so the first case to multiply on a stream would otherwise count them as its leak."""
    if device != "cuda":
        return
    from tendril.graphs.capture import capture_stream

    for stream in (torch.cuda.current_stream(), capture_stream(torch.device("cuda", torch.cuda.current_device()))):
        with torch.cuda.stream(stream):
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                weight = torch.ones(32, 32, device="cuda", dtype=dtype)
                weight @ weight
                torch.nn.functional.linear(weight, weight, weight[0])
    torch.cuda.synchronize()


def _leaked(device: str, baseline: int) -> int:
    """Bytes allocated beyond `baseline`; reference cycles are collected before a leak is reported."""
    leaked = _allocated(device) - baseline
    if leaked > LEAK_TOLERANCE_BYTES:
        leaked = _allocated(device, collect=True) - baseline
    return max(0, leaked)


def run_case(case: Case, device: str = "cpu", backend: Backend | None = None) -> Outcome:
    """Run `case` graphed against eager on `device` ("cpu": on `NullBackend` unless `backend` is given)."""
    outcome = Outcome(case, device, calls=len(case.lengths))
    if device == "cpu" and backend is None:
        backend = NullBackend()
    try:
        models.build(case.model, case.structure, case.dtype, device)
    except ModelUnavailable as missing:
        outcome.status, outcome.detail = "skipped", str(missing)
        return outcome
    _warm_streams(device)
    baseline = _allocated(device)
    try:
        with warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            _execute(case, device, backend)
    except Mismatch as mismatch:
        outcome.status, outcome.detail = "mismatch", str(mismatch)
    except Exception as error:
        outcome.status = "crash"
        outcome.detail = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=-6)}"
    outcome.leaked_bytes = _leaked(device, baseline)
    if not outcome.failed and outcome.leaked_bytes > LEAK_TOLERANCE_BYTES:
        outcome.status = "mismatch"
        outcome.detail = f"{outcome.leaked_bytes / 2**20:.2f} MiB still allocated after the callable was deleted"
    return outcome


def replay(seed: int, device: str = "cpu") -> Outcome:
    """Rerun the case of `seed` and raise `AssertionError` with its message if it fails."""
    outcome = run_case(draw_case(seed), device)
    if outcome.failed:
        raise AssertionError(outcome.message())
    return outcome
