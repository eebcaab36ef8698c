"""Case `sparse-cnn`: tendril's sparse×sparse CNN engine against dense cuDNN and the CPU, batch 1.

AlexNet and VGG-16 pruned to the Deep Compression densities, ResNet-50 to 80% uniform weight
sparsity (torchvision architectures, random weights, fp32, random 224×224 inputs: activation
sparsity is what ReLU gives). Variants, side by side in one process: tendril on the GPU eager and
replayed inside a CUDA graph (and, where `tune` ran some convolutions densely, the same network with
sparse kernels only; and always with every convolution on its fastest dense kernel, cuDNN or cuBLAS on the
pruned weights: what the sparse convolution kernels buy over tendril's own best dense one); dense cuDNN fp32
(TF32 off), TF32 and fp16, each inside a CUDA graph, with PyTorch's
default algorithm choice (cuDNN's heuristic: the targets' baseline), and fp32 also in cuDNN's benchmark mode (its
own search of algorithms, which tendril's dense-fallback layers use);
tendril's CPU implementation of the same algorithm on 1 thread and on all threads; dense PyTorch on
the CPU (1 thread and all threads). Also weight memory against dense (held after `tune`, and what
`release_unused_kernels` leaves: the chosen kernels' copies only), the time `convert` took
(tuning included), and a per-layer breakdown (densities, chosen GPU kernel, GPU and all-thread CPU time
per layer, every kernel `tune` timed per layer, register-tiled kernels it refused and why) in `extra`.
The slow CPU variants get few repetitions (1 warm-up, 3 timed): one VGG-16 forward of the CPU sparse
engine on one thread takes ~0.6 s.
The register-tiled kernels every model's `tune` will time are compiled first, all at once in parallel
processes. `SPARSE_CNN_MODELS=vgg16,resnet50` runs only those models (default: all three).
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from benchmarks.registry import Context, Goal, register
from tendril.graphs.capture import capture
from tendril.sparse import convert, prune
from tendril.sparse.ops.conv.dense.dataflow import fp32_dense_math
from tendril.sparse.ops.conv.register import kernel as register_cuda
from tendril.sparse.ops.conv.register.tiling import RegisterTilePlan
from tendril.sparse.ops.conv.registry import DENSE_KERNELS
from tendril.sparse.steps import SparseConvStep, SparseLinearStep
from tendril.utils.timing import Timing, time_callable

MODELS: dict[str, str | float] = {"alexnet": "alexnet", "vgg16": "vgg16", "resnet50": 0.2}


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max())


def set_tf32(enabled: bool) -> None:
    torch.backends.cudnn.allow_tf32 = enabled
    torch.backends.cuda.matmul.allow_tf32 = enabled


def graphed(fn: Callable[[torch.Tensor], Any], example: torch.Tensor) -> tuple[Callable[[torch.Tensor], Any], Any]:
    placeholder = example.clone()
    captured = capture(fn, placeholder)

    def replay(x: torch.Tensor) -> Any:
        placeholder.copy_(x)
        return captured.replay()

    return replay, captured


def _time_gpu(ctx: Context, fn: Callable[..., Any], inputs: list[torch.Tensor], reps: int) -> Timing:
    return time_callable(fn, [(x,) for x in inputs], device=ctx.device, warmup=5, reps=reps)


def _describe(plan: RegisterTilePlan) -> str:
    if plan.pixel_run:
        return f"pixel run pw {plan.pw} kt {plan.kt} warps {plan.warps} splits {plan.splits}"
    return f"ph {plan.ph} pw {plan.pw} kt {plan.kt} lanes_x {plan.lanes_x} warps {plan.warps} splits {plan.splits}"


def _describe_fc(step: SparseLinearStep) -> str:
    if step.fc_kernel != "rows":
        return f"triton ({step.fc_kernel})"
    c = step.rows_config
    return f"triton (rows {c.block_r}x{c.block_k}, {c.num_warps} warps)"


def pruned_model(ctx: Context, name: str) -> tuple[nn.Module, list[Any]]:
    """The torchvision model on the device with seeded random weights, pruned (the same on every call)."""
    import torchvision

    torch.manual_seed(0)
    model: nn.Module = getattr(torchvision.models, name)(weights=None).eval().to(ctx.device)
    return model, prune(model, MODELS[name])


def precompile_models(ctx: Context, names: list[str]) -> None:
    """Compile every register-tiled kernel the models' `tune` will time, all at once in parallel processes
    (into the NVRTC disk cache, where `tune` then finds them): one pool for all models keeps 16 cores busy."""
    started = time.perf_counter()
    plans = []
    with torch.no_grad():
        for name in names:
            model, _ = pruned_model(ctx, name)
            plans += convert(model, torch.randn(1, 3, 224, 224, device=ctx.device), tune=False).register_plans()
            del model
    try:
        compiled = register_cuda.precompile(plans)
    except Exception as error:  # tune then compiles them one by one
        ctx.note(f"precompiling register-tiled kernels failed ({type(error).__name__}: {error})")
        return
    ctx.note(f"compiled {compiled} register-tiled kernels for {names} in {time.perf_counter() - started:.1f} s")


def _use_fastest_dense_kernels(net: Any) -> None:
    """Give every convolution the dense kernel (cuDNN or cuBLAS on the pruned weights) that `tune` measured fastest
    for it; the fully-connected layers keep their sparse kernels."""
    for step in net.steps:
        if isinstance(step, SparseConvStep):
            times = {k: ms for k, ms in net.kernel_times[step.name].items() if k in DENSE_KERNELS}
            step.dense_weight = step.weights.to_dense().to(net.device)
            step.conv_kernel = min(times, key=lambda k: times[k])


def _bench_model(ctx: Context, name: str) -> None:
    started = time.perf_counter()
    reps = 20 if ctx.quick else 100
    model, pruned = pruned_model(ctx, name)
    inputs = [torch.randn(1, 3, 224, 224, device=ctx.device) for _ in range(4)]
    results: dict[str, Timing] = {}
    with torch.no_grad():
        set_tf32(False)
        started = time.perf_counter()
        net = convert(model, inputs[0])
        ctx.add_value(f"{name} convert (tune included)", "seconds", time.perf_counter() - started)
        reference = model(inputs[1])
        ctx.add_value(f"{name} tendril gpu", "rel_err_vs_dense_fp32", _relative_error(net(inputs[1]), reference))
        results["tendril gpu eager"] = _time_gpu(ctx, net, inputs, reps)
        replay, _ = graphed(net, inputs[0])
        fresh = torch.randn(1, 3, 224, 224, device=ctx.device)
        ctx.add_value(
            f"{name} tendril gpu graph", "rel_err_vs_dense_fp32", _relative_error(replay(fresh), model(fresh))
        )
        results["tendril gpu CUDA graph"] = _time_gpu(ctx, replay, inputs, reps)
        net.check_overflow()
        convs = [s for s in net.steps if isinstance(s, SparseConvStep)]
        kernels = {s.name: s.conv_kernel for s in convs}
        fc_kernels = {s.name: _describe_fc(s) for s in net.steps if isinstance(s, SparseLinearStep)}
        register_plans = {
            s.name: _describe(s.register.plan) for s in convs if s.register and s.conv_kernel == "register"
        }
        counts = {k: list(kernels.values()).count(k) for k in sorted(set(kernels.values()))}
        ctx.note(f"{name}: conv kernels chosen by tune: {counts} of {len(kernels)} convolutions")
        print(f"{name}: conv kernels {counts}; register plans {register_plans}", flush=True)
        net.set_backend("triton")
        triton_replay, _ = graphed(net, inputs[0])
        results["tendril gpu triton-only CUDA graph"] = _time_gpu(ctx, triton_replay, inputs, reps)
        net.set_backend("cuda")
        gpu_layers = dict(net.profile(inputs[2]))
        layers = net.layers()
        kernel_times = {layer: {k: round(ms, 4) for k, ms in t.items()} for layer, t in net.kernel_times.items()}
        compressed, dense = net.weight_bytes()
        in_use, _ = net.weight_bytes(in_use_only=True)
        _use_fastest_dense_kernels(net)  # what sparsity buys the convolutions: the same network, dense convolutions
        dense_replay, _ = graphed(net, inputs[0])
        results["tendril gpu dense-convolutions-only CUDA graph"] = _time_gpu(ctx, dense_replay, inputs, reps)
        del dense_replay
        if any(kernel in DENSE_KERNELS for kernel in kernels.values()):  # the same network with sparse kernels only
            net.dense_fallback = False
            net.tune(inputs[0])
            sparse_replay, _ = graphed(net, inputs[0])
            results["tendril gpu sparse-kernels-only CUDA graph"] = _time_gpu(ctx, sparse_replay, inputs, reps)
            del sparse_replay

        for label, tf32 in (("cuDNN fp32", False), ("cuDNN tf32", True)):
            set_tf32(tf32)
            dense_replay, _ = graphed(model, inputs[0])
            results[f"dense {label} CUDA graph"] = _time_gpu(ctx, dense_replay, inputs, reps)
        set_tf32(False)
        with fp32_dense_math(benchmark=True):  # cuDNN's own search of algorithms, as tendril's dense layers use it
            model(inputs[0])
            searched_replay, _ = graphed(model, inputs[0])
        results["dense cuDNN fp32 benchmark-mode CUDA graph"] = _time_gpu(ctx, searched_replay, inputs, reps)
        half = copy.deepcopy(model).half()
        half_replay, _ = graphed(half, inputs[0].half())
        results["dense cuDNN fp16 CUDA graph"] = _time_gpu(ctx, half_replay, [x.half() for x in inputs], reps)
        del half

        cpu_model = copy.deepcopy(model).cpu()
        cpu_inputs = [x.cpu() for x in inputs[:2]]
        cpu_net = convert(cpu_model, cpu_inputs[0])
        all_threads = os.cpu_count() or 1
        for threads in (1, all_threads):
            torch.set_num_threads(threads)
            cpu_net.set_backend("cpu", threads)
            if threads == all_threads:
                err = _relative_error(cpu_net(cpu_inputs[1]), cpu_model(cpu_inputs[1]))
                ctx.add_value(f"{name} tendril cpu", "rel_err_vs_dense_fp32", err)
            tag = "1 thread" if threads == 1 else f"{threads} threads"
            # one warm-up call: it compiles the numba kernels for these shapes
            results[f"tendril cpu {tag}"] = time_callable(cpu_net, [(x,) for x in cpu_inputs], warmup=1, reps=3)
            results[f"dense pytorch cpu {tag}"] = time_callable(cpu_model, [(x,) for x in cpu_inputs], warmup=1, reps=3)
        cpu_layers = dict(cpu_net.profile(cpu_inputs[0]))

    for variant, timing in results.items():
        ctx.add_timing(f"{name} {variant}", timing)
    print(f"{name}: benchmarked in {time.perf_counter() - started:.1f} s", flush=True)
    best = results["tendril gpu CUDA graph"].median_ms
    ctx.target(
        f"{name}_speedup_vs_cpu_sparse_1thread", results["tendril cpu 1 thread"].median_ms / best, Goal(">=", 171)
    )
    ctx.target(
        f"{name}_speedup_vs_cpu_sparse_allthreads",
        results[f"tendril cpu {all_threads} threads"].median_ms / best,
        Goal(">=", 30),
    )
    ctx.target(
        f"{name}_speedup_vs_cudnn_fp32_graph", results["dense cuDNN fp32 CUDA graph"].median_ms / best, Goal(">", 1)
    )
    searched = results["dense cuDNN fp32 benchmark-mode CUDA graph"].median_ms
    ctx.add_value(f"{name} tendril gpu", "speedup_vs_cudnn_fp32_benchmark_mode_graph", searched / best)
    if "tendril gpu sparse-kernels-only CUDA graph" in results:
        sparse_only = results["tendril gpu sparse-kernels-only CUDA graph"].median_ms
        ctx.add_value(
            f"{name} sparse kernels only",
            "speedup_vs_cudnn_fp32_graph",
            results["dense cuDNN fp32 CUDA graph"].median_ms / sparse_only,
        )
    dense_convs = results["tendril gpu dense-convolutions-only CUDA graph"].median_ms
    ctx.add_value(f"{name} tendril gpu", "speedup_vs_dense_convolutions_only", dense_convs / best)
    ctx.add_value(f"{name} weights", "compressed_MiB", compressed / 2**20)
    ctx.add_value(f"{name} weights", "in_use_MiB", in_use / 2**20)
    ctx.add_value(f"{name} weights", "dense_MiB", dense / 2**20)
    ctx.extra[name] = {
        "pruning": {p.name: round(p.density, 4) for p in pruned},
        "rejected_kernels": dict(net.rejected_kernels),
        "tune_kernel_ms": kernel_times,
        "weight_bytes": {"compressed": compressed, "in_use": in_use, "dense": dense},
        "layers": [
            {
                "layer": r.name,
                "kind": r.kind,
                "weight_density": round(r.weight_density, 4),
                "activation_density": None if r.activation_density is None else round(r.activation_density, 4),
                "gpu_ms": round(gpu_layers.get(r.name, float("nan")), 4),
                "gpu_conv_kernel": kernels.get(r.name, fc_kernels.get(r.name)),
                "register_plan": register_plans.get(r.name),
                "cpu_allthreads_ms": round(cpu_layers.get(r.name, float("nan")), 2),
            }
            for r in layers
        ],
        "dense_steps_gpu_ms": round(
            sum(ms for step, ms in gpu_layers.items() if step not in {r.name for r in layers}), 4
        ),
    }


@register("sparse-cnn", "sparse×sparse CNN engine vs cuDNN and CPU: AlexNet, VGG-16, ResNet-50 (batch 1, fp32)")
def run(ctx: Context) -> None:
    previous = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    try:
        chosen = os.environ.get("SPARSE_CNN_MODELS")
        names = chosen.split(",") if chosen else list(MODELS)
        precompile_models(ctx, names)
        for name in names:
            try:
                _bench_model(ctx, name)
            except Exception as error:  # keep the other models' results; the note says what failed
                ctx.note(f"{name} failed: {type(error).__name__}: {error}")
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = previous
    ctx.note(
        "tendril GPU = convolutions by the register-tiled sparse-weight CUDA kernel (dense input, bias/residual/ReLU "
        "fused), the shared-memory SCNN CUDA kernel or the Triton global-atomic kernel, whichever measured fastest "
        "per layer at conversion (extra.*.layers.gpu_conv_kernel; each candidate's time in extra.*.tune_kernel_ms), "
        "or fp32 dense math on the dense pruned weights (`dense`: cuDNN's convolution, then residual and ReLU; "
        "`dense-fused`: one fused cuDNN call; `gemm`: im2col where needed, one cuBLAS product and a fused epilogue) "
        "where that measured faster than every sparse kernel; compressed_MiB then counts every copy tune leaves "
        "(dense, the shared-memory kernel's tile order, register packing), in_use_MiB the chosen kernels' only, and "
        "the network is also timed with sparse kernels only ('sparse-kernels-only', '<model> sparse kernels only' row) "
        "and with every convolution on its fastest dense kernel ('dense-convolutions-only': what the sparse "
        "convolution kernels buy; its FC layers stay sparse); compression and FC layers in Triton, each FC "
        "by compressed activations x CSC weights with atomics (spmspv) or dense input x a CSR copy (rows), whichever "
        "tune measured faster (the row kernel in the fastest of its launch configurations). Plain forwards count "
        "no activations beyond what the kernels count on the way (`count_activations` off). "
        "CPU = tendril's compiled (numba) CPU engine: zero weights skipped, activations compressed, each conv by "
        "SCNN's Cartesian product or an output-stationary sparse-weight loop, whichever a cost model on the true "
        "nonzero counts picks (tendril.sparse.ops.conv.cpu)."
    )
