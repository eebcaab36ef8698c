"""Case `sparse-cpu`: tendril's CPU sparse engine against dense PyTorch on the CPU (oneDNN), batch 1.

AlexNet and VGG-16 with torchvision's layer shapes and initialization (built here: torchvision is
not always importable beside torch), pruned to the Deep Compression densities, and ResNet-50's
layer shapes (the tests' `ResNetLike` with bottlenecks 3-4-6-3) at 80% uniform sparsity, fp32, random
224×224 inputs (activation sparsity is what ReLU gives). Side by side in one process, on 1 thread
and on all threads (`torch.set_num_threads` for dense PyTorch, numba's pool for tendril):

- whole networks: tendril's CPU backend (`SparseNetwork.set_backend("cpu", threads)`) against the
  dense model on the same pruned weights, with the relative error of the output;
- per layer: each sparse step (the dense input into phase planes, counting nonzeros, + convolution
  or FC with bias and ReLU fused; compression too when SCNN's dataflow runs) against the dense
  `Conv2d`/`Linear` module alone, both on that layer's input in the dense forward;
  and, on 1 thread, both conv dataflows forced (`cartesian`, SCNN's Cartesian product, and
  `direct`, sparse weights × dense planes) to show what the per-layer cost model chooses between.

Targets: `{net}_cpu_sparse_speedup_vs_dense_1thread` and `_allthreads` (dense time / sparse time,
goal >= 1: the sparse engine should at least match oneDNN), and `{net}_cpu_sparse_thread_scaling`
(1-thread time / all-thread time, goal > 1).

The machine this was written on is shared with other jobs, so sparse and dense calls are
interleaved, and besides wall time the process CPU time of every call is recorded: on one thread it
is the call's run time minus what other processes took, and the 1-thread targets and per-layer
1-thread times use it; all-thread targets use wall time (CPU time sums the threads).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.registry import Context, Goal, register
from tendril.sparse import convert, prune
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
DENSITIES: dict[str, str | float] = {"alexnet": "alexnet", "vgg16": "vgg16", "resnet50": 0.2}
"""Deep Compression's per-layer densities for AlexNet and VGG-16; 80% uniform sparsity for ResNet-50."""


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


def _bench(ctx: Context, name: str) -> None:
    torch.manual_seed(0)
    reps = 3 if ctx.quick else 9
    model = MODELS[name]().eval()
    pruned = prune(model, DENSITIES[name])
    inputs = [torch.randn(1, 3, 224, 224) for _ in range(3)]
    all_threads = os.cpu_count() or 1
    with torch.no_grad():
        net = convert(model, inputs[0])
        modules = dict(model.named_modules())
        dense_inputs = _layer_inputs(model, inputs[0])
        sparse_steps = [s for s in net.steps if isinstance(s, (SparseConvStep, SparseLinearStep))]
        totals: dict[int, tuple[float, float]] = {}
        per_layer: dict[str, dict[str, Any]] = {s.name: {} for s in sparse_steps}
        for threads in sorted({1, all_threads}):
            torch.set_num_threads(threads)
            net.set_backend("cpu", threads)
            tag = "1 thread" if threads == 1 else f"{threads} threads"
            if threads == all_threads:
                err = _relative_error(net(inputs[1]), model(inputs[1]))
                ctx.add_value(f"{name} tendril cpu", "rel_err_vs_dense_fp32", err)
            timings = _interleaved({"sparse": net, "dense": model}, inputs, reps)
            (sparse, sparse_cpu), (dense, dense_cpu) = timings["sparse"], timings["dense"]
            ctx.add_timing(f"{name} tendril cpu sparse {tag}", sparse)
            ctx.add_timing(f"{name} dense pytorch cpu {tag}", dense)
            ctx.add_timing(f"{name} tendril cpu sparse {tag}", sparse_cpu, "process_cpu_ms_per_call")
            ctx.add_timing(f"{name} dense pytorch cpu {tag}", dense_cpu, "process_cpu_ms_per_call")
            if threads == 1:
                totals[threads] = (sparse_cpu.median_ms, dense_cpu.median_ms)
            else:
                totals[threads] = (sparse.median_ms, dense.median_ms)
            reports = {r.name: r for r in net.layers()}
            key = "1thread" if threads == 1 else "allthreads"
            clock = time.process_time if threads == 1 else time.perf_counter
            state = RunState("cpu", threads, torch.zeros(1, dtype=torch.int32))
            for step in sparse_steps:
                module, x = modules[step.name], dense_inputs[step.name]
                step_inputs = [x]
                if isinstance(step, SparseConvStep) and step.residual:
                    g = step.weights.geometry
                    step_inputs.append(torch.zeros(1, g.out_channels, *g.out_hw))
                tendril_ms = _time_ms(functools.partial(step.run, step_inputs, state), reps, clock)
                per_layer[step.name][f"tendril_ms_{key}"] = round(tendril_ms, 3)
                per_layer[step.name][f"dense_ms_{key}"] = round(_time_ms(functools.partial(module, x), reps, clock), 3)
        torch.set_num_threads(1)
        net.set_backend("cpu", 1)
        for step in sparse_steps:
            entry, report = per_layer[step.name], reports[step.name]
            entry.update(
                {
                    "kind": report.kind,
                    "weight_density": round(report.weight_density, 4),
                    "activation_density": round(report.activation_density or 0.0, 4),
                }
            )
            if isinstance(step, SparseConvStep) and step.cpu_plan is not None:
                plan = step.cpu_plan
                x = dense_inputs[step.name][0]
                acts = compress_cpu.compress(x, step.layout)
                entry["auto_choice"] = plan.choose(acts.stored_counts)
                out = torch.empty(step.weights.geometry.out_channels, *step.weights.geometry.out_hw)
                for method in ("cartesian", "direct"):
                    forced = functools.partial(
                        conv_cpu.conv_dense_input, x, plan, step.bias, out=out, layout=step.layout, method=method
                    )
                    ms = _time_ms(forced, max(1, reps // 2), time.process_time)
                    entry[f"{method}_conv_ms_1thread"] = round(ms, 3)
        torch.set_num_threads(all_threads)

    (sparse_1, dense_1), (sparse_n, dense_n) = totals[1], totals[all_threads]
    ctx.target(f"{name}_cpu_sparse_speedup_vs_dense_1thread", dense_1 / sparse_1, Goal(">=", 1))
    ctx.target(f"{name}_cpu_sparse_speedup_vs_dense_allthreads", dense_n / sparse_n, Goal(">=", 1))
    ctx.target(f"{name}_cpu_sparse_thread_scaling", sparse_1 / sparse_n, Goal(">", 1))
    ctx.extra[name] = {
        "threads": [1, all_threads],
        "pruning": {p.name: round(p.density, 4) for p in pruned},
        "layers": [{"layer": layer, **entry} for layer, entry in per_layer.items()],
    }


@register(
    "sparse-cpu", "tendril's CPU sparse CNN engine vs dense PyTorch CPU: AlexNet, VGG-16, ResNet-50", needs_gpu=False
)
def run(ctx: Context) -> None:
    for name in MODELS:
        _bench(ctx, name)
    ctx.note(
        "tendril cpu = compiled (numba) kernels; per conv layer the cost model picks SCNN's Cartesian product "
        "or the output-stationary sparse-weight dataflow (extra.*.layers.auto_choice, with both timed on 1 "
        "thread); FC layers are column-gather Cartesian products over the nonzero inputs. Dense = PyTorch CPU "
        "(oneDNN) on the same pruned weights. Per-layer tendril times include reading the dense input into "
        "phase planes (or compressing it), bias and ReLU; dense per-layer "
        "times are the Conv2d/Linear module alone."
    )
