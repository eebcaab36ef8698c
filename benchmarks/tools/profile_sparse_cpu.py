"""Where the multi-threaded time of tendril's sparse CPU engine goes: fixed costs per parallel region against work.

ResNet-50 at weight density 0.1, batch 1, built as the `sparse-cpu` case builds it, at each thread count of
`--threads` (numba's pool, torch on one thread, as in a forward: `cpu_threads.kernel_threads`):
1. an empty `prange` region back to back and after `GAPS_US` of busy Python work (the glue between kernels), beside
   a serial compiled call (numba's dispatch alone): the wake-up cost per region by gap;
2. representative layers (`representative_layers`): each compiled kernel the layer's call runs, called again
   directly on the same arguments, and the layer's whole call (torch on one thread, and at the thread count as
   `sparse-cpu` times layers);
3. the whole forward, and traced forwards with every kernel call timed: calls, parallel regions (`regions_per_call`),
   time inside kernels and between them, the gaps between calls; compared with regions × the wake-up cost, and with
   the glue alone (`stubbed_kernels`: no kernel runs, so none leaves the caches cold).

The markdown report is written by `sparse_cpu_report`.

    PYTHONPATH=src:. python3 -m benchmarks.tools.profile_sparse_cpu --out OUT [--threads 1,2,4,8,16] [--quick]

`--quick`: a small bottleneck ResNet on a 64×64 input, few repetitions, at most 2 threads, regions per call not
counted (that compiles uncached kernel copies, seconds each). Counts above numba's pool size are left out (and
listed). Writes OUT/profile_sparse_cpu.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numba
import numpy as np
import torch
from numba import njit, prange
from numba.core.dispatcher import Dispatcher
from torch import nn

from benchmarks.cases import sparse_cpu as case
from benchmarks.tools.sparse_cpu_report import markdown
from tendril.sparse import SparseNetwork, convert, prune
from tendril.sparse.ops import cpu_threads
from tendril.sparse.steps import RunState, SparseConvStep, SparseLinearStep
from tendril.utils.timing import summarize
from tests.sparse.models import Bottleneck, ResNetLike

DENSITY = 0.1
GAPS_US = (0, 20, 200, 2000)
"""Busy Python work before each timed empty region (0: back to back)."""
REGION_REPS = {0: 400, 20: 400, 200: 200, 2000: 50}
LAYER_REPS = 40
FORWARD_REPS = 15
TRACED_FORWARDS = 5
QUICK_DIVISOR = 10
"""`--quick` divides every repetition count by this (at least 3 each)."""
ENV_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "NUMBA_")


@njit(parallel=True, cache=True)
def empty_region(out):
    for i in prange(out.shape[0]):
        out[i] += 1.0


@njit(cache=True)
def serial_call(out):
    out[0] += 1.0


@dataclass
class KernelCall:
    kernel: str
    step: str | None
    start: float
    end: float
    run: Callable[[], Any]
    """The same call again: the compiled kernel on the same arguments."""


class KernelTrace:
    """While `installed`, every call of a compiled kernel (`cpu_kernels`, which the operators look up by
    attribute at each call) is timed and recorded with the step that made it."""

    def __init__(self) -> None:
        self.calls: list[KernelCall] = []
        self.steps: list[tuple[str, float, float]] = []
        self._step: str | None = None

    @contextlib.contextmanager
    def installed(self, steps: Sequence[Any] = ()) -> Iterator[KernelTrace]:
        module = cpu_threads.kernels()
        originals = compiled_kernels(module)
        for name, kernel in originals.items():
            setattr(module, name, self._timed(name, kernel))
        for step in steps:
            step.run = self._named(step, step.run)
        try:
            yield self
        finally:
            for name, kernel in originals.items():
                setattr(module, name, kernel)
            for step in steps:
                del step.run

    def _timed(self, name: str, kernel: Dispatcher) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            start = time.perf_counter()
            result = kernel(*args)
            end = time.perf_counter()
            self.calls.append(KernelCall(name, self._step, start, end, functools.partial(kernel, *args)))
            return result

        return call

    def _named(self, step: Any, run: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            self._step, start = step.name, time.perf_counter()
            result = run(*args)
            self.steps.append((step.name, start, time.perf_counter()))
            return result

        return call


def compiled_kernels(module: ModuleType) -> dict[str, Dispatcher]:
    """The module's compiled functions that the operators call (not the helpers inlined into them): those with
    parallel loops, whose every call enters at least one parallel region, and the serial ones."""
    return {k: v for k, v in vars(module).items()
            if isinstance(v, Dispatcher) and v.targetoptions.get("inline", "never") == "never"}


def regions_per_call(kernel: Dispatcher) -> int | None:
    """Parallel regions one call of `kernel` enters: the `numba_parallel_for` launches in the LLVM IR of an uncached
    copy compiled for each signature the kernel has run with (numba withholds the IR of cached code), the most over
    signatures; None if it has not run. A static count: no kernel here starts a region inside a serial loop."""
    options = {k: v for k, v in kernel.targetoptions.items() if k != "nopython"}
    copy = njit(**options)(kernel.py_func)
    counts = []
    for signature in kernel.signatures:
        copy.compile(signature)
        ir = copy.inspect_llvm(signature)
        counts.append(len(re.findall(r"call [^\n]*@numba_parallel_for\(", ir)))
    return max(counts) if counts else None


def _samples(fn: Callable[[], Any], reps: int, gap_s: float = 0.0) -> list[float]:
    """Seconds per call of `fn` (after one untimed call), each call after `gap_s` of busy Python work."""
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter() + gap_s
        while time.perf_counter() < start:  # busy Python work
            pass
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def _us(samples_s: Sequence[float], scale: float = 1e6, digits: int = 2) -> dict[str, float]:
    """Median, p10 and p90 of the samples (seconds) in microseconds (or in the unit `scale` says)."""
    t = summarize([s * scale for s in samples_s])
    return {**{k: round(getattr(t, f"{k}_ms"), digits) for k in ("median", "p10", "p90")}, "n": t.n}


def region_costs(threads: int, reps: dict[int, int]) -> dict[str, Any]:
    """Part 1 at one thread count: the empty region by gap, and numba's dispatch alone (a serial compiled call)."""
    out = np.zeros(1024, dtype=np.float32)
    with cpu_threads.kernel_threads(threads):
        serial = _us(_samples(lambda: serial_call(out), reps[0]))
        regions = {str(gap): _us(_samples(lambda: empty_region(out), reps[gap], gap * 1e-6)) for gap in GAPS_US}
    wake = {gap: round(r["median"] - serial["median"], 2) for gap, r in regions.items()}
    return {"serial_call_us": serial, "region_us": regions, "wake_us": wake}


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch's thread count set to `threads` meanwhile (as `sparse-cpu` sets it before timing layers alone)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def build(quick: bool) -> tuple[SparseNetwork, torch.Tensor, dict[str, list[torch.Tensor]]]:
    """The network as `sparse-cpu` builds it (ResNet-50, or under `--quick` a small bottleneck ResNet), its input,
    and each representative layer's arguments to `step.run` (its input in the dense forward, a zero residual)."""
    torch.manual_seed(0)
    model: nn.Module = (ResNetLike(Bottleneck, (1, 1, 1, 1), width=8) if quick else case.resnet50()).eval()
    prune(model, DENSITY)
    case._rescale(model, DENSITY)
    x = torch.randn(1, 3, *((64, 64) if quick else (224, 224)))
    with torch.no_grad():
        net = convert(model, x)
        dense_inputs = case._layer_inputs(model, x)
    steps = {s.name: s for s in net.steps}
    layer_inputs = {name: [dense_inputs[name]] for name in representative_layers(net)}
    for name, args in layer_inputs.items():
        step = steps[name]
        if isinstance(step, SparseConvStep) and step.residual:  # a zero residual, as `sparse-cpu` gives
            args.append(torch.zeros(1, step.weights.geometry.out_channels, *step.weights.geometry.out_hw))
    return net, x, layer_inputs


def representative_layers(net: SparseNetwork) -> dict[str, list[str]]:
    """Step name → its roles (in network order): among stride-1 convolutions, the first 3×3 and the first 1×1 at
    the largest output plane, the 1×1 with the most input and the one with the most output channels at the
    smallest; the first strided 3×3 and 1×1, where the network has them; and the last FC layer. On ResNet-50:
    layers.0.0.conv2, layers.0.0.conv1, layers.3.1.conv1, layers.3.0.conv3, layers.1.0.conv2,
    layers.1.0.downsample.0, fc."""
    all_convs = [s for s in net.steps if isinstance(s, SparseConvStep)]
    convs = [s for s in all_convs if s.weights.geometry.stride == (1, 1)]
    three = [s for s in convs if s.weights.geometry.kernel == (3, 3)]
    one = [s for s in convs if s.weights.geometry.kernel == (1, 1)]
    strided = {kernel: [s for s in all_convs if s.weights.geometry.kernel == kernel and s not in convs]
               for kernel in ((3, 3), (1, 1))}  # fmt: skip
    fcs = [s for s in net.steps if isinstance(s, SparseLinearStep)]
    if not three or not one or not fcs:
        raise ValueError("the network needs stride-1 3×3 and 1×1 convolutions and an FC layer")

    def area(step: SparseConvStep) -> int:
        return step.weights.geometry.out_hw[0] * step.weights.geometry.out_hw[1]

    smallest = [s for s in one if area(s) == min(map(area, one))]
    chosen = {
        "3×3 at the largest plane": max(three, key=area).name,
        "1×1 at the largest plane": max(one, key=area).name,
        "1×1 at the smallest plane, most input channels": max(
            smallest, key=lambda s: s.weights.geometry.in_channels).name,
        "1×1 at the smallest plane, most output channels": max(
            smallest, key=lambda s: s.weights.geometry.out_channels).name,
        **{f"the first strided {k[0]}×{k[1]}": steps[0].name for k, steps in strided.items() if steps},
        "the FC layer": fcs[-1].name,
    }
    roles: dict[str, list[str]] = {s.name: [] for s in net.steps}
    for role, name in chosen.items():
        roles[name].append(role)
    return {name: r for name, r in roles.items() if r}


def _shape(step: Any) -> str:
    if isinstance(step, SparseLinearStep):
        return f"FC {step.weights.in_features}→{step.weights.out_features}"
    g = step.weights.geometry
    return (f"{g.kernel[0]}×{g.kernel[1]}/{g.stride[0]} {g.in_channels}→{g.out_channels} at "
            f"{g.out_hw[0]}×{g.out_hw[1]}{' +residual' if step.residual else ''}")


def profile_layer(step: Any, args: list[torch.Tensor], threads: int, reps: int, library: bool) -> dict[str, Any]:
    """Part 2 at one thread count: the layer's kernels called directly, its call inside `kernel_threads`, and its
    call alone with torch at `threads` (as `sparse-cpu` times layers); `library`: the network's `cpu_library`."""
    state = RunState("cpu", threads, torch.zeros(1, dtype=torch.int32), library=library)
    trace = KernelTrace()
    with torch.no_grad(), cpu_threads.kernel_threads(threads):
        step.run(args, state)
        with trace.installed():
            step.run(args, state)
        kernels = [{"kernel": c.kernel, "us": _us(_samples(c.run, reps))} for c in trace.calls]
        call = _us(_samples(lambda: step.run(args, state), reps))
    with torch.no_grad(), torch_threads(threads):
        alone = _us(_samples(lambda: step.run(args, state), reps))
    total = round(sum(k["us"]["median"] for k in kernels), 2)
    return {"kernels": kernels, "kernels_us": total, "call_us": call, "call_torch_at_threads_us": alone}


STUB_PRODUCTS = 1 << 60
"""What a stubbed kernel returns: as a counting kernel's cartesian products, so many that layers take the direct
dataflow, whose (stubbed) call they then make."""


@contextlib.contextmanager
def stubbed_kernels() -> Iterator[None]:
    """Every compiled kernel replaced by a call that returns `STUB_PRODUCTS` at once, outputs unwritten: a forward
    then runs its glue alone, on caches no kernel has made cold (torch's products still run, on one thread)."""
    module = cpu_threads.kernels()
    originals = compiled_kernels(module)
    for name in originals:
        setattr(module, name, lambda *args: STUB_PRODUCTS)
    try:
        yield
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)


def profile_forward(net: SparseNetwork, x: torch.Tensor, threads: int, reps: int, traced: int) -> dict[str, Any]:
    """Part 3 at one thread count: the whole forward untraced (wall and process CPU), `traced` forwards with every
    kernel call timed (`summarize_traces` reduces them once the regions per call are known), and forwards with the
    kernels stubbed (`glue_alone_ms`: the time outside kernels when they leave the caches warm)."""
    net.set_backend("cpu", threads)
    wall, cpu = [], []
    with torch.no_grad():
        net(x)
        for _ in range(reps):
            start, start_cpu = time.perf_counter(), time.process_time()
            net(x)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        traces = []
        for _ in range(traced):
            trace = KernelTrace()
            with trace.installed(net.steps):
                start = time.perf_counter()
                net(x)
                traces.append((trace, time.perf_counter() - start))
        with stubbed_kernels():
            glue = _samples(lambda: net(x), reps)
    wall_s, cpu_s = statistics.median(wall), statistics.median(cpu)
    busy = round(cpu_s / wall_s, 2)
    return {"ms": _us(wall, 1e3, 4), "process_cpu_ms": round(cpu_s * 1e3, 4), "busy_threads": busy,
            "glue_alone_ms": _us(glue, 1e3, 4), "traces": traces}  # fmt: skip


def summarize_traces(forward: dict[str, Any], regions: dict[str, int | None]) -> None:
    """Replace the raw traces of `profile_forward` by medians over the traced forwards: kernel calls and parallel
    regions (None where a kernel's regions per call were not counted), the traced forward's time inside kernels
    and outside them (Python glue and torch ops), the gaps between consecutive kernel calls, per kernel and per
    step."""
    traces = forward.pop("traces")
    first = traces[0][0]
    if any(len(t.calls) != len(first.calls) or len(t.steps) != len(first.steps) for t, _ in traces):
        raise RuntimeError("the traced forwards ran different kernel sequences")
    call_s = [statistics.median(t.calls[i].end - t.calls[i].start for t, _ in traces) for i in range(len(first.calls))]
    inside = [sum(c.end - c.start for c in t.calls) for t, _ in traces]
    outside = [total - kernels for (_, total), kernels in zip(traces, inside, strict=True)]
    gaps = [b.start - a.end for t, _ in traces for a, b in itertools.pairwise(t.calls)]
    by_kernel: dict[str, dict[str, Any]] = {}
    for call, seconds in zip(first.calls, call_s, strict=True):
        entry = by_kernel.setdefault(call.kernel, {"calls": 0, "regions_per_call": regions.get(call.kernel), "ms": 0.0})
        entry["calls"] += 1
        entry["ms"] += seconds * 1e3
    steps = []
    for j, (name, _, _) in enumerate(first.steps):
        kernels = [{"kernel": c.kernel, "us": round(s * 1e6, 2)}
                   for c, s in zip(first.calls, call_s, strict=True) if c.step == name]
        step_s = statistics.median(t.steps[j][2] - t.steps[j][1] for t, _ in traces)
        steps.append({"step": name, "us": round(step_s * 1e6, 2), "kernels": kernels})
    counted = all(e["regions_per_call"] is not None for e in by_kernel.values())
    forward.update(
        traced_ms=round(statistics.median(s for _, s in traces) * 1e3, 4),
        kernel_calls=len(first.calls),
        regions=sum(e["calls"] * e["regions_per_call"] for e in by_kernel.values()) if counted else None,
        kernel_ms=round(statistics.median(inside) * 1e3, 4),
        glue_ms=round(statistics.median(outside) * 1e3, 4),
        gap_us=_us(gaps) if gaps else None,
        by_kernel={k: {**v, "ms": round(v["ms"], 4)} for k, v in by_kernel.items()},
        steps=steps,
    )


def wake_estimate(forward: dict[str, Any], region: dict[str, Any]) -> dict[str, Any] | None:
    """Regions × the empty region's wake-up cost (over a serial compiled call) after the measured gap nearest (on a
    log scale) the forward's median gap between kernel calls."""
    if forward["regions"] is None or forward["gap_us"] is None:
        return None
    gap = max(forward["gap_us"]["median"], 1.0)
    nearest = min(GAPS_US, key=lambda g: abs(math.log(max(g, 1.0) / gap)))
    wake = region["wake_us"][str(nearest)]
    return {"gap_us": nearest, "wake_us": wake, "ms": round(forward["regions"] * wake / 1e3, 4)}


def host() -> dict[str, Any]:
    """The host's CPUs (as `sparse-cpu` records them), this process's CPU affinity, the load average, and the
    OpenMP and TBB runtimes mapped into the process (torch's and numba's: one shared runtime or two copies)."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    load = [round(v, 2) for v in os.getloadavg()] if hasattr(os, "getloadavg") else None
    maps = Path("/proc/self/maps")
    paths = {line.split()[-1] for line in maps.read_text().splitlines()} if maps.exists() else set()
    runtimes = sorted(p for p in paths if re.match(r"lib(gomp|iomp5|omp|tbb)", Path(p).name))
    return {**case.host_cpus(), "affinity": affinity, "load_average": load, "platform": platform.platform(),
            "runtimes": runtimes}


def _thread_counts(text: str) -> list[int]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or not all(v.isdigit() and int(v) >= 1 for v in values):
        raise ValueError(f"--threads {text!r}: expected thread counts of at least 1, separated by commas, e.g. 1,2,4")
    return sorted({int(v) for v in values})


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", default="1,2,4,8,16", help="thread counts, e.g. 1,2,4,8,16")
    parser.add_argument("--quick", action="store_true", help="a small network, few repetitions, 1 and 2 threads")
    args = parser.parse_args(argv)
    requested = _thread_counts(args.threads)
    module = cpu_threads.kernels()  # numba's pool on the engine's threading layer, before anything parallel runs
    pool = numba.config.NUMBA_NUM_THREADS
    usable = [n for n in requested if n <= pool and (not args.quick or n <= 2)]
    if not usable:
        raise ValueError(f"--threads {args.threads}: none fits numba's pool of {pool} threads")
    scale = QUICK_DIVISOR if args.quick else 1
    region_reps = {gap: max(3, reps // scale) for gap, reps in REGION_REPS.items()}
    net, x, layer_inputs = build(args.quick)
    roles = representative_layers(net)
    report: dict[str, Any] = {
        "tool": "profile_sparse_cpu",
        "command": " ".join(["python3 -m benchmarks.tools.profile_sparse_cpu", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quick": args.quick, "model": "small bottleneck ResNet" if args.quick else "resnet50", "density": DENSITY,
        "input": list(x.shape), "threads": usable, "threads_left_out": sorted(set(requested) - set(usable)),
        "host": host(), "torch": torch.__version__, "numba": numba.__version__, "numba_pool_threads": pool,
        "torch_parallel_info": torch.__config__.parallel_info().splitlines(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "notes": [], "empty_region": {}, "forward": {},
    }  # fmt: skip
    steps = {s.name: s for s in net.steps}
    layers: dict[str, dict[str, Any]] = {name: {} for name in roles}
    for n in usable:
        start = time.perf_counter()
        report["empty_region"][str(n)] = region_costs(n, region_reps)
        for name, per in layers.items():
            per[str(n)] = profile_layer(steps[name], layer_inputs[name], n, max(3, LAYER_REPS // scale),
                                        net.cpu_library)
        forward = profile_forward(net, x, n, max(3, FORWARD_REPS // scale), max(2, TRACED_FORWARDS // scale))
        report["forward"][str(n)] = forward
        print(f"{n} threads: forward {forward['ms']['median']:.3f} ms, {time.perf_counter() - start:.1f} s", flush=True)
    kernels = compiled_kernels(module)
    if args.quick:
        regions: dict[str, int | None] = dict.fromkeys(kernels)
        report["notes"].append("--quick: regions per call not counted (compiling uncached kernel copies takes seconds)")
    else:
        start = time.perf_counter()
        regions = {name: regions_per_call(kernel) for name, kernel in kernels.items()}
        print(f"regions per call counted ({time.perf_counter() - start:.1f} s)", flush=True)
    for n, forward in report["forward"].items():
        summarize_traces(forward, regions)
        forward["wake_estimate"] = wake_estimate(forward, report["empty_region"][n])
    report.update(
        regions_per_call=regions,
        layers=[{"layer": name, "shape": _shape(steps[name]), "roles": roles, "threads": layers[name]}
                for name, roles in roles.items()],
        numba_threading_layer=cpu_threads.threading_layer(),
    )
    report["host"]["load_average_after"] = host()["load_average"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_sparse_cpu.json").write_text(json.dumps(report, indent=1))
    (args.out / "profile_sparse_cpu.md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    main()
