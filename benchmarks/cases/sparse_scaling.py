"""Case `sparse-scaling`: does tendril's time follow the nonzeros? Pruned CNNs at falling densities, fp16, batch 1.

ResNet-50, VGG-16 and AlexNet (torchvision architectures, seeded random weights), every conv and FC layer pruned
uniformly (`tendril.sparse.prune` with one density) to 0.3, 0.2, 0.1 and 0.05, random 224×224 inputs. Variants,
side by side in one process, each replayed inside a CUDA graph:
- dense cuDNN fp32 (TF32 off), the reference every variant's error is measured against (relative L2 error, on the
  same pruned weights and the same input);
- dense TF32;
- dense fp16, channels_last, `cudnn.benchmark` on (cuDNN's own algorithm search): the speedup targets' baseline;
- tendril default in fp16 (`convert(model.half(), x.half())`: `tune` picks per layer among the sparse kernels
  that run fp16 and the dense ones, cuDNN or cuBLAS in fp16);
- tendril sparse kernels only in fp16 (`dense_fallback=False`, tuned again).
On the CPU: dense PyTorch (oneDNN) on all threads, the best CPU baseline (timed once per model: dense math does
not see the zeros), and tendril's own CPU engine in fp32 on all threads (few repetitions; the CPU engine is fp32
only), both against tendril's fp16 GPU time.

Where the time goes: `extra["<model>_d<density>"]["layers"]` lists per layer the weight and input activation
density, the kernel each tendril variant chose, every kernel's per-call time as `tune` measured it (device time,
behind a GPU sleep) and the time of compressing the layer's input alone (what the compressed-input kernels pay
before any multiply). The markdown has, per model and density, the table of each convolution's best sparse
kernel against its best dense fp16 kernel.

Environment: `SPARSE_SCALING_MODELS=vgg16,alexnet` and `SPARSE_SCALING_DENSITIES=0.3,0.05` restrict the runs (the
targets whose runs are left out are not reported); `SPARSE_SCALING_CPU=0` leaves out the CPU variants. `--quick`:
AlexNet at density 0.1, no CPU variants, few repetitions, unless the variables say otherwise.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.cases.sparse_cnn import graphed, set_tf32
from benchmarks.registry import Context, Goal, register
from tendril.sparse import SparseNetwork, convert, prune
from tendril.sparse.ops.compress import triton as compress_triton
from tendril.sparse.ops.conv.registry import DENSE_KERNELS
from tendril.sparse.steps import SparseConvStep, SparseLinearStep
from tendril.sparse.tuning import device_ms
from tendril.utils.timing import Timing, time_callable

MODELS = ("resnet50", "vgg16", "alexnet")
DENSITIES = (0.3, 0.2, 0.1, 0.05)
IMAGE_SIZE = 224
TUNE_REPS = 10
"""Calls per candidate kernel in `tune` (its times are for all of them; the profile divides)."""
SPEEDUP_GOALS = {
    "resnet50_d0.1_speedup_vs_cudnn_fp16": Goal(">=", 1.5),
    "vgg16_d0.1_speedup_vs_cudnn_fp16": Goal(">=", 1.5),
    "alexnet_d0.1_speedup_vs_cudnn_fp16": Goal(">=", 1.5),
    "resnet50_d0.3_speedup_vs_cudnn_fp16": Goal(">=", 1.0),
}
DENSE_FP16 = "dense cuDNN fp16 channels_last benchmark-mode CUDA graph"
TENDRIL = "tendril fp16 CUDA graph"
SPARSE_ONLY = "tendril fp16 sparse-kernels-only CUDA graph"
FP16_VARIANTS = (DENSE_FP16, TENDRIL, SPARSE_ONLY)


def relative_l2(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((y.double() - ref).norm() / ref.norm())


def _choice(name: str, default: tuple[Any, ...], parse: Callable[[str], Any]) -> tuple[Any, ...]:
    chosen = os.environ.get(name)
    return tuple(parse(v) for v in chosen.split(",")) if chosen else default


@torch.no_grad()
def pruned_model(ctx: Context, name: str, density: float) -> nn.Module:
    """The torchvision model with seeded random weights (the same for every density), pruned uniformly, each
    layer's surviving weights scaled to keep the layer's weight norm: without it, the activations of a deep random
    network shrink by the kept fraction of each layer's energy, layer after layer, and at density 0.05 VGG-16's
    output falls below fp16's normal range (fine-tuning a pruned network restores the scale likewise)."""
    import torchvision

    torch.manual_seed(0)
    model: nn.Module = getattr(torchvision.models, name)(weights=None).eval().to(ctx.device)
    layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    norms = [m.weight.norm() for m in layers]
    prune(model, density)
    for layer, norm in zip(layers, norms, strict=True):
        layer.weight.mul_(norm / layer.weight.norm().clamp_min(torch.finfo(torch.float32).tiny))
    return model


def _time(ctx: Context, fn: Callable[..., Any], inputs: list[torch.Tensor], reps: int) -> Timing:
    return time_callable(fn, [(x,) for x in inputs], device=ctx.device, warmup=5, reps=reps)


def _graph_and_time(
    ctx: Context, fn: Callable[[torch.Tensor], Any], inputs: list[torch.Tensor], check: torch.Tensor, reps: int
) -> tuple[Timing, torch.Tensor]:
    """Time `fn` replayed in a CUDA graph; also its output on `check` (from the graph)."""
    replay, captured = graphed(fn, inputs[0])
    timing = _time(ctx, replay, inputs, reps)
    y = replay(check).clone()
    del replay, captured
    return timing, y


def _dense_variants(
    ctx: Context, model: nn.Module, inputs: list[torch.Tensor], check: torch.Tensor, reps: int
) -> tuple[dict[str, Timing], dict[str, torch.Tensor]]:
    times, outputs = {}, {}
    cudnn = torch.backends.cudnn
    for label, tf32 in (("dense cuDNN fp32 CUDA graph", False), ("dense TF32 CUDA graph", True)):
        set_tf32(tf32)
        times[label], outputs[label] = _graph_and_time(ctx, model, inputs, check, reps)
    set_tf32(False)
    half = copy.deepcopy(model).half().to(memory_format=torch.channels_last)
    half_inputs = [x.half().contiguous(memory_format=torch.channels_last) for x in inputs]
    previous, cudnn.benchmark = cudnn.benchmark, True
    try:
        half(half_inputs[0])  # cuDNN searches its algorithms here, eagerly
        check_half = check.half().contiguous(memory_format=torch.channels_last)
        times[DENSE_FP16], outputs[DENSE_FP16] = _graph_and_time(ctx, half, half_inputs, check_half, reps)
    finally:
        cudnn.benchmark = previous
    return times, outputs


def _layer_inputs_and_compression(net: SparseNetwork, x: torch.Tensor) -> dict[str, dict[str, float]]:
    """One forward; per convolution, the time of compressing its input alone (per call) and the input's density."""
    values = {net.input_name: x}
    overflow = torch.zeros(1, dtype=torch.int32, device=x.device)
    found = {}
    for step in net.steps:
        args = [values[name] for name in step.inputs]
        if isinstance(step, SparseConvStep):
            sample = args[0][0].contiguous()
            compress = functools.partial(compress_triton.compress, sample, step.layout, overflow)
            ms = device_ms(compress, TUNE_REPS) / TUNE_REPS
            found[step.name] = {"compress_ms": ms, "activation_density": float((sample != 0).float().mean())}
        values[step.output] = step.run(args, net.state)
    return found


def _profile(
    net: SparseNetwork, tuned: dict[str, dict[str, float]], sparse_only: dict[str, str], x: torch.Tensor
) -> list[dict[str, Any]]:
    """Per layer: densities, each variant's kernel, every timed kernel's per-call ms, the compression alone."""
    compression = _layer_inputs_and_compression(net, x)
    layers = []
    for step in net.steps:
        if not isinstance(step, (SparseConvStep, SparseLinearStep)):
            continue
        kernel_ms = {k: round(ms / TUNE_REPS, 5) for k, ms in tuned.get(step.name, {}).items()}
        entry: dict[str, Any] = {
            "layer": step.name,
            "kind": "conv" if isinstance(step, SparseConvStep) else "linear",
            "weight_density": round(step.weights.density, 4),
            "kernel_default": None,
            "kernel_sparse_only": sparse_only.get(step.name),
            "kernel_ms": kernel_ms,
        }
        if isinstance(step, SparseConvStep):
            entry["activation_density"] = round(compression[step.name]["activation_density"], 4)
            entry["compress_ms"] = round(compression[step.name]["compress_ms"], 5)
            sparse = {k: ms for k, ms in kernel_ms.items() if k not in DENSE_KERNELS}
            dense = {k: ms for k, ms in kernel_ms.items() if k in DENSE_KERNELS}
            entry["best_sparse_ms"] = min(sparse.values()) if sparse else None
            entry["best_dense_fp16_ms"] = min(dense.values()) if dense else None
        layers.append(entry)
    return layers


def _layer_table(layers: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| layer | weight density | act. density | sparse kernel | sparse ms | of it compression ms "
        "| dense fp16 ms | sparse / dense |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in layers:
        if r["kind"] != "conv" or r["best_sparse_ms"] is None:
            continue
        dense = r["best_dense_fp16_ms"]
        dense_text, ratio = (f"{dense:.4f}", f"{r['best_sparse_ms'] / dense:.2f}") if dense else ("-", "-")
        lines.append(
            f"| {r['layer']} | {r['weight_density']:.3f} | {r['activation_density']:.3f} | {r['kernel_sparse_only']} "
            f"| {r['best_sparse_ms']:.4f} | {r['compress_ms']:.4f} | {dense_text} | {ratio} |"
        )
    return lines


def _tendril_variants(
    ctx: Context, model: nn.Module, inputs: list[torch.Tensor], check: torch.Tensor, reps: int, key: str
) -> tuple[dict[str, Timing], dict[str, torch.Tensor]]:
    """tendril in fp16, tuned with the dense fallback and then without it; the per-layer profile into `extra`."""
    half = copy.deepcopy(model).half()
    half_inputs = [x.half() for x in inputs]
    net = convert(half, half_inputs[0], tune=False)
    net.tune(half_inputs[0], reps=TUNE_REPS)
    chosen = {s.name: s.conv_kernel for s in net.steps if isinstance(s, SparseConvStep)}
    chosen |= {s.name: s.fc_kernel for s in net.steps if isinstance(s, SparseLinearStep)}
    tuned = copy.deepcopy(net.kernel_times)
    times, outputs = {}, {}
    times[TENDRIL], outputs[TENDRIL] = _graph_and_time(ctx, net, half_inputs, check.half(), reps)
    net.check_overflow()
    net.dense_fallback = False
    sparse_only = net.tune(half_inputs[0], reps=TUNE_REPS)
    times[SPARSE_ONLY], outputs[SPARSE_ONLY] = _graph_and_time(ctx, net, half_inputs, check.half(), reps)
    net.check_overflow()
    for layer, ms in net.kernel_times.items():  # sparse-only times measured again: keep both, the first wins ties
        for kernel, t in ms.items():
            tuned.setdefault(layer, {}).setdefault(kernel, t)
    layers = _profile(net, tuned, sparse_only, half_inputs[0])
    for r in layers:
        r["kernel_default"] = chosen.get(r["layer"])
    counts = {k: list(chosen.values()).count(k) for k in sorted(set(chosen.values()))}
    ctx.note(f"{key}: kernels chosen by tune (fp16, dense fallback allowed): {counts}")
    ctx.extra[key] = {"layers": layers, "rejected_kernels": {k: dict(v) for k, v in net.rejected_kernels.items()}}
    ctx.extra.setdefault("markdown_tables", {})[f"{key}: sparse kernels against dense fp16, per convolution"] = (
        _layer_table(layers)
    )
    return times, outputs


def _cpu_variants(ctx: Context, model: nn.Module, x: torch.Tensor, dense_ms: float | None) -> dict[str, Timing]:
    """Dense PyTorch on all threads (unless `dense_ms` was measured already) and tendril's CPU engine (fp32)."""
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    cpu_model = copy.deepcopy(model).cpu()
    cpu_x = [x.cpu()]
    times = {}
    with torch.no_grad():
        if dense_ms is None:
            times["dense oneDNN cpu all threads"] = time_callable(cpu_model, [(v,) for v in cpu_x], warmup=1, reps=3)
        cpu_net = convert(cpu_model, cpu_x[0]).set_backend("cpu", threads)
        times["tendril cpu fp32 all threads"] = time_callable(cpu_net, [(v,) for v in cpu_x], warmup=1, reps=2)
    return times


def _bench(ctx: Context, name: str, density: float, cpu: bool, cpu_dense: dict[str, float]) -> dict[str, Any]:
    key = f"{name}_d{density:g}"
    reps = 10 if ctx.quick else 50
    model = pruned_model(ctx, name, density)
    generator = torch.Generator(device=ctx.device).manual_seed(1)
    shape = (1, 3, IMAGE_SIZE, IMAGE_SIZE)
    inputs = [torch.randn(shape, device=ctx.device, generator=generator) for _ in range(3)]
    check = torch.randn(shape, device=ctx.device, generator=generator)
    with torch.no_grad():
        set_tf32(False)
        reference = model(check).clone()
        times, outputs = _dense_variants(ctx, model, inputs, check, reps)
        tendril_times, tendril_outputs = _tendril_variants(ctx, model, inputs, check, reps, key)
    times |= tendril_times
    outputs |= tendril_outputs
    if cpu:
        cpu_times = _cpu_variants(ctx, model, inputs[0], cpu_dense.get(name))
        times |= cpu_times
        if "dense oneDNN cpu all threads" in cpu_times:
            cpu_dense[name] = cpu_times["dense oneDNN cpu all threads"].median_ms
    for variant, timing in times.items():
        ctx.add_timing(f"{key} {variant}", timing)
    errors = {variant: relative_l2(y, reference) for variant, y in outputs.items()}
    for variant, error in errors.items():
        ctx.add_value(f"{key} {variant}", "rel_l2_err_vs_dense_fp32", error)
    best = times[TENDRIL].median_ms
    ctx.add_value(f"{key} {TENDRIL}", "speedup_vs_cudnn_fp16", times[DENSE_FP16].median_ms / best)
    sparse_only_speedup = times[DENSE_FP16].median_ms / times[SPARSE_ONLY].median_ms
    ctx.add_value(f"{key} {SPARSE_ONLY}", "speedup_vs_cudnn_fp16", sparse_only_speedup)
    if name in cpu_dense:
        ctx.add_value(f"{key} {TENDRIL}", "speedup_vs_cpu_dense_onednn_allthreads", cpu_dense[name] / best)
    if "tendril cpu fp32 all threads" in times:
        tendril_cpu = times["tendril cpu fp32 all threads"].median_ms
        ctx.add_value(f"{key} {TENDRIL}", "speedup_vs_tendril_cpu_allthreads", tendril_cpu / best)
    del model
    torch.cuda.empty_cache()
    return {
        "speedup": times[DENSE_FP16].median_ms / best,
        "sparse_only_ms": times[SPARSE_ONLY].median_ms,
        "max_fp16_error": max(errors[v] for v in FP16_VARIANTS),
    }


@register("sparse-scaling", "tendril fp16 vs cuDNN fp16 as weight density falls: ResNet-50, VGG-16, AlexNet, batch 1")
def run(ctx: Context) -> None:
    quick_models, quick_densities = ("alexnet",), (0.1,)
    models = _choice("SPARSE_SCALING_MODELS", quick_models if ctx.quick else MODELS, str)
    densities = _choice("SPARSE_SCALING_DENSITIES", quick_densities if ctx.quick else DENSITIES, float)
    cpu = os.environ.get("SPARSE_SCALING_CPU", "0" if ctx.quick else "1") != "0"
    unknown = set(models) - set(MODELS)
    if unknown:
        raise ValueError(f"SPARSE_SCALING_MODELS: unknown {sorted(unknown)}; expected some of {MODELS}")
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    found: dict[str, dict[str, Any]] = {}
    cpu_dense: dict[str, float] = {}
    try:
        for name in models:
            for density in densities:
                try:
                    found[f"{name}_d{density:g}"] = _bench(ctx, name, density, cpu, cpu_dense)
                except Exception as error:  # keep the other runs' results; the note says what failed
                    ctx.note(f"{name} at density {density:g} failed: {type(error).__name__}: {error}")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous
    for target, goal in SPEEDUP_GOALS.items():
        key = target.removesuffix("_speedup_vs_cudnn_fp16")
        if key in found:
            ctx.target(target, found[key]["speedup"], goal)
    if "vgg16_d0.05" in found and "vgg16_d0.3" in found:
        ratio = found["vgg16_d0.05"]["sparse_only_ms"] / found["vgg16_d0.3"]["sparse_only_ms"]
        ctx.target("vgg16_sparse_only_time_d0.05_over_d0.3", ratio, Goal("<=", 0.4))
    if found:
        ctx.target("max_rel_error_fp16", max(r["max_fp16_error"] for r in found.values()), Goal("<=", 1e-2))
    ctx.note(
        "Speedups are dense cuDNN fp16 (channels_last, cudnn.benchmark, CUDA graph) over tendril fp16 (CUDA graph). "
        "Errors: relative L2 against dense cuDNN fp32 (TF32 off) on the same pruned weights and input. Per-layer "
        "tables: the fastest sparse kernel `tune` timed on the layer against the fastest dense fp16 kernel it timed "
        "(tendril's cuDNN/cuBLAS on the pruned weights, NCHW), per call, device time; 'of it compression' is the "
        "Triton compression of the layer's input alone, which every compressed-input kernel pays. Kernels that do "
        "not run fp16 (the CUDA C++ ones) are skipped by tune, reason in extra.*.rejected_kernels."
    )
