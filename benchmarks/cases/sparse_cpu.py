"""Case `sparse-cpu`: tendril's CPU sparse CNN engine against dense PyTorch on the CPU (oneDNN), batch 1.

AlexNet, VGG-16 and ResNet-50 with torchvision's layer shapes and initialization (built here:
torchvision is not always importable beside torch), pruned uniformly to weight densities 0.3, 0.1 and
0.05, fp32, random 224×224 inputs (activation sparsity is what ReLU gives). The dense baseline runs the
same pruned weights with BatchNorm folded into the convolutions (`torch.fx`'s `fuse`, as tendril's
`convert` folds them). Side by side in one process, on 1 thread and on all threads
(`torch.set_num_threads` for dense PyTorch, `set_backend("cpu", threads)` for tendril):

- whole networks: tendril's CPU backend against the dense model, with the relative error of the output;
- per layer (`extra.<net>_d<density>.layers`, the profile): each sparse step (conv or FC with bias,
  residual and ReLU fused, counting its input's nonzeros) against the dense `Conv2d`/`Linear` module
  alone, both on that layer's input in the dense forward, on both thread counts; and on 1 thread, every
  compiled dataflow forced (`direct` and `cartesian`: see `ops/conv/cpu/kernel.py`), the library doing the
  same product (torch's sparse CSR × dense `addmm`, MKL's sparse BLAS, on the input itself for 1×1
  layers, else on `F.unfold`'s im2col columns, unfold included) and the activation compression alone
  (what SCNN's dataflow needs first);
- inside a forward (`extra.<net>_d<density>.forward_steps_ms`): every step's wall time in tendril's forward at
  each thread count, pooling and flattening included, and their sum beside the layers as
  `other_steps_ms_in_forward`.

Targets: `{net}_d{density}_cpu_speedup_vs_dense_1thread` and `_allthreads` (dense time / tendril time)
and `{net}_d{density}_cpu_thread_scaling` (tendril's 1-thread time / all-thread time), with the goals
in `TARGETS` (the thread-scaling goal is meant for a 16-core host). Beside it, `{net}_d{density}_dense_thread_scaling`
is dense oneDNN's own, and `extra.host_cpus` the host's logical CPUs and physical cores. A host's cores run slower
when all are busy than one alone (turbo), by an amount that differs between hosts and days, so the all-thread speedup
a perfectly parallel program reaches differs too: `host_clock` measures it before and after each model's parts (the
`host` rows and `extra.<net>_d<density>.host_clock`), and `thread_scaling_over_ceiling` is each side's scaling over it.

Splitting (each part a separate `run`, so that a part fits one time-limited call; unset = all):
`SPARSE_CPU_MODELS` (e.g. `resnet50,vgg16`), `SPARSE_CPU_DENSITIES` (e.g. `0.1`) and `SPARSE_CPU_THREADS`
(`1`, `all` or a count; default `1,all`). A target is reported where its part ran both sides (the thread scaling
needs 1 and all threads in one part). Expected times with the default reps: on a 2-core development host the
whole case took about 3.5 minutes (VGG-16 about half of it, AlexNet the least); on 16 cores the 1-thread parts
take about as long and the all-thread parts less, unless dense PyTorch's OpenMP pool collapses under other load
(seconds per call). So one model per call (`SPARSE_CPU_MODELS=vgg16`, then `resnet50`, then `alexnet`) fits an
8-minute call with a wide margin; split VGG-16 by density as well if a call runs long.

The machine this was written on is shared with other jobs, so sparse and dense calls are
interleaved, and besides wall time the process CPU time of every call is recorded: on one thread it
is the call's run time minus what other processes took, and the 1-thread targets and per-layer
1-thread times use it; all-thread targets use wall time (CPU time sums the threads).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.optimization import fuse

from benchmarks import host_clock
from benchmarks.registry import Context, Goal, register
from tendril.sparse import convert, prune
from tendril.sparse.network import SparseNetwork
from tendril.sparse.ops import cpu_threads
from tendril.sparse.ops.compress import cpu as compress_cpu
from tendril.sparse.ops.conv.cpu import kernel as conv_cpu
from tendril.sparse.steps import RunState, SparseConvStep, SparseLinearStep
from tendril.utils.timing import Timing, summarize
from tests.sparse.models import Bottleneck, ResNetLike


def alexnet() -> nn.Module:
    """torchvision's AlexNet (layer shapes and default initialization)."""
    return _Net(
        nn.Sequential(
            nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
        ),
        6,
        nn.Sequential(
            nn.Dropout(), nn.Linear(256 * 36, 4096), nn.ReLU(inplace=True),
            nn.Dropout(), nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Linear(4096, 1000),
        ),
    )  # fmt: skip


def vgg16() -> nn.Module:
    """torchvision's VGG-16 (configuration D, its layer shapes and initialization)."""
    layers: list[nn.Module] = []
    channels = 3
    for width in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if width == "M":
            layers.append(nn.MaxPool2d(2, 2))
        else:
            assert isinstance(width, int)
            layers += [nn.Conv2d(channels, width, 3, padding=1), nn.ReLU(inplace=True)]
            channels = width
    model = _Net(
        nn.Sequential(*layers),
        7,
        nn.Sequential(
            nn.Linear(512 * 49, 4096), nn.ReLU(True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(True), nn.Dropout(), nn.Linear(4096, 1000),
        ),
    )  # fmt: skip
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.zeros_(m.bias)  # type: ignore[arg-type]
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0, 0.01)
            nn.init.zeros_(m.bias)
    return model


class _Net(nn.Module):
    def __init__(self, features: nn.Module, pooled: int, classifier: nn.Module) -> None:
        super().__init__()
        self.features, self.avgpool, self.classifier = features, nn.AdaptiveAvgPool2d(pooled), classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def resnet50() -> nn.Module:
    """ResNet-50's layer shapes (bottlenecks 3-4-6-3, width 64, 1000 classes), BatchNorm folded by `convert`."""
    model = ResNetLike(Bottleneck, (3, 4, 6, 3), width=64)
    model.fc = nn.Linear(2048, 1000)
    return model


MODELS: dict[str, Callable[[], nn.Module]] = {"alexnet": alexnet, "vgg16": vgg16, "resnet50": resnet50}
DENSITIES = (0.3, 0.1, 0.05)
"""Uniform weight densities (every Conv2d and Linear layer pruned to the same fraction by magnitude)."""
TARGETS = {
    "resnet50_d0.1_cpu_speedup_vs_dense_1thread": Goal(">=", 1.5),
    "resnet50_d0.1_cpu_speedup_vs_dense_allthreads": Goal(">=", 1.5),
    "vgg16_d0.1_cpu_speedup_vs_dense_1thread": Goal(">=", 2),
    "vgg16_d0.1_cpu_speedup_vs_dense_allthreads": Goal(">=", 2),
    "resnet50_d0.1_cpu_thread_scaling": Goal(">=", 6),
}
"""The goals; every other model and density reports the same keys without one."""


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max())


Forward = Callable[[torch.Tensor], Any]


def _interleaved(fns: dict[str, Forward], inputs: list[torch.Tensor], reps: int) -> dict[str, tuple[Timing, Timing]]:
    """Time several callables call by call in turn (rotating inputs), so that load from other processes
    on a shared machine hits them alike; one warm-up call each. Per callable: (wall, process CPU) time."""
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(inputs[0])
    for i in range(reps):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn(inputs[i % len(inputs)])
            wall[name].append((time.perf_counter() - start) * 1e3)
            cpu[name].append((time.process_time() - start_cpu) * 1e3)
    return {name: (summarize(wall[name]), summarize(cpu[name])) for name in fns}


def _time_ms(fn: Callable[[], Any], reps: int, clock: Callable[[], float]) -> float:
    """Median time of `fn()` by `clock` (`time.process_time` on one thread, `time.perf_counter` on several)."""
    fn()
    samples = []
    for _ in range(reps):
        start = clock()
        fn()
        samples.append((clock() - start) * 1e3)
    return statistics.median(samples)


def _layer_inputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The input of every Conv2d/Linear module in one dense forward, by module name."""
    captured: dict[str, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda _m, args, name=name: captured.__setitem__(name, args[0].clone()))
        for name, m in model.named_modules()
        if isinstance(m, (nn.Conv2d, nn.Linear))
    ]
    model(x)
    for h in hooks:
        h.remove()
    return captured


def _choice(name: str, default: list[str]) -> list[str]:
    chosen = os.environ.get(name, "").strip()
    return [v.strip() for v in chosen.split(",") if v.strip()] if chosen else default


def _thread_counts(all_threads: int) -> list[int]:
    """`SPARSE_CPU_THREADS` (`1`, `all` or counts; default both ends), sorted, without repeats."""
    counts = set()
    for value in _choice("SPARSE_CPU_THREADS", ["1", "all"]):
        if value != "all" and not value.isdigit():
            raise ValueError(f"SPARSE_CPU_THREADS={value!r}: expected 1, all, or a thread count")
        counts.add(all_threads if value == "all" else int(value))
    return sorted(counts)


def _bench(ctx: Context, name: str, density: float) -> None:
    torch.manual_seed(0)
    reps = 3 if ctx.quick else 9
    model = MODELS[name]().eval()
    prune(model, density)
    _rescale(model, density)
    dense = fuse(copy.deepcopy(model))
    inputs = [torch.randn(1, 3, 224, 224) for _ in range(3)]
    all_threads = os.cpu_count() or 1
    thread_counts = _thread_counts(all_threads)
    tag = f"{name}_d{density:g}"
    clocks = [host_clock.measure(all_threads)] if len(thread_counts) > 1 else []
    with torch.no_grad():
        net = convert(model, inputs[0])
        modules = dict(model.named_modules())
        dense_inputs = _layer_inputs(model, inputs[0])
        steps = [s for s in net.steps if isinstance(s, (SparseConvStep, SparseLinearStep))]
        per_layer: dict[str, dict[str, Any]] = {s.name: {} for s in steps}
        totals: dict[int, tuple[float, float]] = {}
        reports: dict[str, Any] = {}
        forward_steps: dict[str, dict[str, float]] = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            net.set_backend("cpu", threads)
            label = "1 thread" if threads == 1 else f"{threads} threads"
            if threads == thread_counts[-1]:
                ctx.add_value(
                    f"{tag} tendril cpu", "rel_err_vs_dense_fp32", _relative_error(net(inputs[1]), dense(inputs[1]))
                )
            timings = _interleaved({"sparse": net, "dense": dense}, inputs, reps)
            (sparse, sparse_cpu), (dense_t, dense_cpu) = timings["sparse"], timings["dense"]
            ctx.add_timing(f"{tag} tendril cpu {label}", sparse)
            ctx.add_timing(f"{tag} dense pytorch cpu {label}", dense_t)
            ctx.add_timing(f"{tag} tendril cpu {label}", sparse_cpu, "process_cpu_ms_per_call")
            ctx.add_timing(f"{tag} dense pytorch cpu {label}", dense_cpu, "process_cpu_ms_per_call")
            if threads == 1:
                totals[threads] = (sparse_cpu.median_ms, dense_cpu.median_ms)
            else:
                totals[threads] = (sparse.median_ms, dense_t.median_ms)
            in_forward = _forward_steps_ms(net, inputs[0], reps)
            outside = sum(ms for step, ms in zip(net.steps, in_forward.values(), strict=True)
                          if not isinstance(step, (SparseConvStep, SparseLinearStep)))  # fmt: skip
            ctx.add_value(f"{tag} tendril cpu {label}", "other_steps_ms_in_forward", outside)
            forward_steps[label] = in_forward
            if not reports:
                net.count_activations = True
                net(inputs[0])
                net.count_activations = False
                reports = {r.name: r for r in net.layers()}
            key = "1thread" if threads == 1 else "allthreads" if threads == all_threads else f"{threads}threads"
            clock = time.process_time if threads == 1 else time.perf_counter
            state = RunState("cpu", threads, torch.zeros(1, dtype=torch.int32), library=net.cpu_library)
            for step in steps:
                module, x = modules[step.name], dense_inputs[step.name]
                step_inputs = [x]
                if isinstance(step, SparseConvStep) and step.residual:
                    g = step.weights.geometry
                    step_inputs.append(torch.zeros(1, g.out_channels, *g.out_hw))
                entry = per_layer[step.name]
                entry[f"tendril_ms_{key}"] = _time_ms(functools.partial(step.run, step_inputs, state), reps, clock)
                entry[f"dense_ms_{key}"] = _time_ms(functools.partial(module, x), reps, clock)
        torch.set_num_threads(1)
        net.set_backend("cpu", 1)
        for step in steps:
            entry = per_layer[step.name]
            entry.update(
                kind=reports[step.name].kind,
                weight_density=round(reports[step.name].weight_density, 4),
                activation_density=round(reports[step.name].activation_density or 0.0, 4),
            )
            if isinstance(step, SparseConvStep) and 1 in thread_counts:
                entry.update(
                    _conv_alternatives(step, modules[step.name], dense_inputs[step.name], reps, net.cpu_library)
                )
            for k, v in entry.items():
                if isinstance(v, float):
                    entry[k] = round(v, 3)
        torch.set_num_threads(all_threads)

    if clocks:
        clocks.append(host_clock.measure(all_threads))
    values = {}
    if 1 in totals:
        values[f"{tag}_cpu_speedup_vs_dense_1thread"] = totals[1][1] / totals[1][0]
    if all_threads in totals and all_threads > 1:
        values[f"{tag}_cpu_speedup_vs_dense_allthreads"] = totals[all_threads][1] / totals[all_threads][0]
        if 1 in totals:
            values[f"{tag}_cpu_thread_scaling"] = totals[1][0] / totals[all_threads][0]
            values[f"{tag}_dense_thread_scaling"] = totals[1][1] / totals[all_threads][1]
    for key, value in values.items():
        ctx.target(key, value, TARGETS.get(key))
    if clocks:
        ceiling = statistics.mean(c.scaling_ceiling for c in clocks)
        ctx.add_value(f"{tag} host", "clock_ratio_all_cores_over_one", statistics.mean(c.ratio for c in clocks))
        ctx.add_value(f"{tag} host", "thread_scaling_ceiling", ceiling)
        for who, side in (("tendril cpu", "cpu"), ("dense pytorch cpu", "dense")):
            if f"{tag}_{side}_thread_scaling" in values:
                scaling = values[f"{tag}_{side}_thread_scaling"]
                ctx.add_value(f"{tag} {who}", "thread_scaling_over_ceiling", scaling / ceiling)
    ctx.extra[tag] = {
        "cpu_library_1thread": net.cpu_library,
        "cpu_library_ms": net.cpu_library_ms,
        "host_clock": [dataclasses.asdict(c) for c in clocks],
        "threads": thread_counts,
        "layers": [{"layer": k, **v} for k, v in per_layer.items()],
        "forward_steps_ms": forward_steps,
    }


def _forward_steps_ms(net: SparseNetwork, x: torch.Tensor, reps: int) -> dict[str, float]:
    """Each step's wall time inside a forward (`SparseNetwork.profile` without counting inputs), the median over
    `reps` forwards, rounded to µs: where a forward's time goes beside its layers (pooling, flattening)."""
    runs = [net.profile(x, count_inputs=False) for _ in range(reps)]
    return {name: round(statistics.median(run[i][1] for run in runs), 3) for i, (name, _) in enumerate(runs[0])}


def _rescale(model: nn.Module, density: float) -> None:
    """Scale the pruned weights by `density ** -0.5`, so that activations keep their magnitude through the
    random network (the output's relative error then measures the arithmetic, not a vanishing signal)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                m.weight.mul_(density**-0.5)


def _conv_alternatives(
    step: SparseConvStep, module: nn.Module, x: torch.Tensor, reps: int, library: bool
) -> dict[str, Any]:
    """On 1 thread: each dataflow forced, the library's sparse product, the compression alone; `library`: the
    network's `cpu_library`."""
    assert step.cpu_plan is not None and isinstance(module, nn.Conv2d)
    plan, g, x = step.cpu_plan, step.weights.geometry, x[0]
    out = torch.empty(g.out_channels, *g.out_hw)
    if plan.csr is not None and library:
        chosen = "spmm"
    else:
        chosen = plan.choose(compress_cpu.compress(x, step.layout).stored_counts)
    times: dict[str, Any] = {"auto_choice_1thread": chosen}
    n = max(1, reps // 2)
    for method in ("direct", "cartesian"):
        forced = functools.partial(
            conv_cpu.conv_dense_input, x, plan, step.bias, out=out, layout=step.layout, method=method
        )
        times[f"{method}_ms_1thread"] = _time_ms(forced, n, time.process_time)
    if g.groups == 1:
        times["mkl_csr_ms_1thread"] = _time_ms(_mkl_product(step, x), n, time.process_time)
    times["compress_ms_1thread"] = _time_ms(lambda: compress_cpu.compress(x, step.layout), n, time.process_time)
    return times


def _mkl_product(step: SparseConvStep, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The layer as torch's sparse CSR × dense `addmm` (MKL's sparse BLAS) with the bias: on the input itself for
    an unpadded 1×1 stride-1 layer, else on `F.unfold`'s im2col columns (the unfold timed too)."""
    g = step.weights.geometry
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        csr = step.weights.to_dense().view(g.out_channels, -1).to_sparse_csr()
    bias = step.bias.view(-1, 1)
    if g.kernel == (1, 1) and g.stride == (1, 1) and g.padding == (0, 0):
        return lambda: torch.addmm(bias, csr, x.view(g.in_channels, -1))
    return lambda: torch.addmm(bias, csr, F.unfold(x[None], g.kernel, padding=g.padding, stride=g.stride)[0])


def host_cpus(cpuinfo: str | None = None) -> dict[str, Any]:
    """The host's logical CPUs, physical cores (distinct package and core ids in /proc/cpuinfo; None where it
    does not say) and CPU model: what bounds thread scaling (hyperthreads share a core's FMA units)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    cores, models, package = set(), set(), ""
    for line in cpuinfo.splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "physical id":
            package = value
        elif key == "core id":
            cores.add((package, value))
        elif key == "model name":
            models.add(value)
    return {"logical": os.cpu_count(), "physical_cores": len(cores) or None, "model": ", ".join(sorted(models))}


@register(
    "sparse-cpu", "tendril's CPU sparse CNN engine vs dense PyTorch CPU: AlexNet, VGG-16, ResNet-50", needs_gpu=False
)
def run(ctx: Context) -> None:
    names = _choice("SPARSE_CPU_MODELS", list(MODELS))
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise ValueError(f"SPARSE_CPU_MODELS: unknown models {unknown}; expected some of {list(MODELS)}")
    densities = [float(d) for d in _choice("SPARSE_CPU_DENSITIES", [str(d) for d in DENSITIES])]
    for name in names:
        for density in densities:
            _bench(ctx, name, density)
    ctx.note(
        "tendril cpu = per conv layer the compiled (numba) output-stationary sparse-weight dataflow or SCNN's "
        "Cartesian product by a cost model, and on 1 thread MKL's CSR product for unpadded 1×1 layers where "
        "convert's tune timed the forward faster with it (extra.*.cpu_library_1thread, cpu_library_ms; "
        "extra.*.layers.auto_choice_1thread; each dataflow forced, MKL's CSR product and the compression alone "
        "timed on 1 thread); FC layers are compiled column-gather products over the nonzero inputs; max pools are "
        "compiled separable maxima, parallel over channels (torch's NCHW max_pool2d, which the dense model runs, "
        "is a scalar loop at batch 1). "
        "Dense = PyTorch CPU (oneDNN) on the same pruned weights, BatchNorm folded. Per-layer tendril times include "
        "filling the phase planes (counting the input's nonzeros on the way; 1×1 layers count only when asked), "
        "bias, residual and ReLU; dense per-layer times are the Conv2d/Linear module alone. "
        f"tendril's kernels ran on numba's {cpu_threads.threading_layer()!r} threading layer, torch on one thread "
        "during its forwards."
    )
    ctx.extra["numba_threading_layer"] = cpu_threads.threading_layer()
    ctx.extra["host_cpus"] = host_cpus()
    ctx.note(f"host: {ctx.extra['host_cpus']}; `*_dense_thread_scaling` is oneDNN's own, for reference")
