"""Case `sparse-conv-kernels`: tendril's GPU convolution kernels on VGG-16's 13 conv layers, one layer
at a time, against cuDNN fp32 (TF32 off), each variant replayed inside a CUDA graph, batch 1, 224×224.

Per layer: weights random and magnitude-pruned to the Deep Compression density of that layer,
input a ReLU-like activation (|N(0,1)| kept with the layer's activation density as tendril measured
it on VGG-16, benchmarks/results/sparse-cnn.json). Variants, as each runs inside a network:
- `old`: the shared-memory SCNN kernel (`ops/conv/cartesian_cuda/`) with what it needs per layer in a
  network: compression of the input (Triton), the init (bias) copy, the convolution with ReLU;
- `register`: the register-tiled sparse-weight kernel (`ops/conv/register/`) with the plan
  its planner picks (dense input, bias and ReLU fused, nothing else needed), and `ALTERNATES` more
  plans (`register alt N`): the next best-predicted ones that differ from those already taken in
  their register tile (ph, pw, kt) or warp count, to check the planner against the device;
- `cuDNN fp32`: `F.conv2d` + bias + ReLU.
Two input tensors alternate between replays (one graph captured per input), so no replay finds its
input in L2 from the replay before. Every output is checked against cuDNN's (relative error).

Targets: `vgg16_conv_register_speedup_vs_cudnn_fp32` (sum of cuDNN's layer times / sum of the
register kernel's best plan per layer; goal > 1), `vgg16_conv_register_speedup_vs_old` (> 1); the
planner's own pick is summed too (`vgg16 conv layers register (planner pick)`), and the per-layer
ratios, plans (tile, shared memory, registers estimate) and predicted times (`estimate_us`) against
the measured ones are in `extra.layers`. All plans are compiled first, in parallel processes.
Set `TENDRIL_NCU_LAYER=N` to run only VGG-16 layer N's planner pick (for a profiler), nothing else.

ResNet-50's 1×1 convolutions (bottleneck reduce/expand, strided downsample; 80% uniform weight sparsity,
activation densities as tendril measured them in sparse-cnn.json) run the same way (`resnet50 1x1 ...`
sums, `extra.resnet50_1x1_layers`); for them the register kernel's alternates include the best plan of
the other layout (pixel runs against 2-D tiles). `SPARSE_CONV_LAYERS=vgg16` or `=resnet50_1x1` runs
only that set (default: both); the VGG-16 targets are reported when its layers run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.registry import Context, Goal, register
from tendril.sparse.activations import ActivationLayout
from tendril.sparse.format import ConvGeometry, SparseConvWeights
from tendril.sparse.ops.compress import triton as compress_triton
from tendril.sparse.ops.conv.cartesian_cuda import kernel as conv_cuda
from tendril.sparse.ops.conv.cartesian_cuda import tiling
from tendril.sparse.ops.conv.register import kernel as register_cuda
from tendril.sparse.ops.conv.register import planner as register_planner
from tendril.sparse.ops.conv.register import tiling as register_tiling
from tendril.utils.timing import Timing, summarize

# (in channels, out channels, input size, Deep Compression weight density, activation density)
VGG16_LAYERS = [
    (3, 64, 224, 0.58, 1.0),
    (64, 64, 224, 0.22, 0.50),
    (64, 128, 112, 0.34, 0.87),
    (128, 128, 112, 0.36, 0.47),
    (128, 256, 56, 0.53, 0.67),
    (256, 256, 56, 0.24, 0.51),
    (256, 256, 56, 0.42, 0.49),
    (256, 512, 28, 0.32, 0.61),
    (512, 512, 28, 0.27, 0.50),
    (512, 512, 28, 0.34, 0.50),
    (512, 512, 14, 0.35, 0.54),
    (512, 512, 14, 0.29, 0.49),
    (512, 512, 14, 0.36, 0.53),
]
# (name, in channels, out channels, input size, stride, activation density): ResNet-50's distinct 1×1 layers
RESNET50_1X1_LAYERS = [
    ("layer1.0.conv1", 64, 64, 56, 1, 1.0),
    ("layer1.0.conv3", 64, 256, 56, 1, 0.51),
    ("layer1.1.conv1", 256, 64, 56, 1, 0.49),
    ("layer2.0.conv1", 256, 128, 56, 1, 0.70),
    ("layer2.0.downsample", 256, 512, 56, 2, 0.70),
    ("layer2.1.conv1", 512, 128, 28, 1, 0.49),
    ("layer2.1.conv3", 128, 512, 28, 1, 0.56),
    ("layer3.0.downsample", 512, 1024, 28, 2, 0.69),
    ("layer3.1.conv1", 1024, 256, 14, 1, 0.50),
    ("layer3.1.conv3", 256, 1024, 14, 1, 0.48),
    ("layer4.0.conv1", 1024, 512, 14, 1, 0.75),
    ("layer4.0.downsample", 1024, 2048, 14, 2, 0.75),
    ("layer4.1.conv1", 2048, 512, 7, 1, 0.50),
    ("layer4.1.conv3", 512, 2048, 7, 1, 0.48),
]
RESNET50_WEIGHT_DENSITY = 0.2
ALTERNATES = 3

Layer = tuple[str, ConvGeometry, float, float]
"""(name, geometry, weight density asked for, activation density) of one benchmarked layer."""


def _vgg16_layers() -> list[Layer]:
    return [
        (f"conv{i + 1:02d} {c}->{k} @{size}", ConvGeometry(c, k, (3, 3), (1, 1), (1, 1), 1, (size, size)), wd, ad)
        for i, (c, k, size, wd, ad) in enumerate(VGG16_LAYERS)
    ]


def _resnet50_1x1_layers() -> list[Layer]:
    return [
        (
            f"{name} {c}->{k} @{size}/{stride}",
            ConvGeometry(c, k, (1, 1), (stride, stride), (0, 0), 1, (size, size)),
            RESNET50_WEIGHT_DENSITY,
            ad,
        )
        for name, c, k, size, stride, ad in RESNET50_1X1_LAYERS
    ]


def _pruned_weight(g: ConvGeometry, density: float, gen: torch.Generator) -> torch.Tensor:
    (r, s), c = g.kernel, g.in_channels
    w = torch.randn(g.out_channels, c, r, s, generator=gen) * (2.0 / (r * s * c)) ** 0.5
    keep = max(1, round(density * w.numel()))
    threshold = w.abs().flatten().kthvalue(w.numel() - keep + 1).values
    return w * (w.abs() >= threshold)


def _relu_like(c: int, size: int, density: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(c, size, size, generator=gen).abs() * (torch.rand(c, size, size, generator=gen) < density)


def _time_graphs(fns: list[Callable[[], Any]], reps: int) -> tuple[Timing, list[Any]]:
    """Capture each callable in its own CUDA graph and time replays alternating between them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graphs, outputs = [], []
    for fn in fns:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs.append(fn())
        graphs.append(graph)
    for i in range(5):
        graphs[i % len(graphs)].replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        start.record()
        graphs[i % len(graphs)].replay()
        end.record()
    torch.cuda.synchronize()
    return summarize([s.elapsed_time(e) for s, e in events]), outputs


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30))


def _bench_layer(ctx: Context, layer: Layer, gen: torch.Generator, reps: int, sms: int) -> dict[str, Any]:
    """Time and check the three variants on one layer; returns its `extra.layers` entry."""
    name, g, w_density, a_density = layer
    c, k, size = g.in_channels, g.out_channels, g.in_hw[0]
    weight = _pruned_weight(g, w_density, gen).to(ctx.device)
    bias = (torch.randn(k, generator=gen) * 0.1).to(ctx.device)
    inputs = [_relu_like(c, size, a_density, gen).to(ctx.device) for _ in range(2)]
    weights = SparseConvWeights.from_dense(weight, g)

    cudnn, references = _time_graphs(
        [lambda x=x: F.conv2d(x[None], weight, bias, stride=g.stride, padding=g.padding)[0].relu_() for x in inputs],
        reps,
    )
    ctx.add_timing(f"{name} cuDNN fp32", cudnn)

    tiled = tiling.TiledWeights.prepare(weights, tiling.plan(g, target_blocks=2 * sms))
    layout = ActivationLayout.for_conv(g)
    flag = torch.zeros(1, dtype=torch.int32, device=ctx.device)
    init = torch.empty(k, *g.out_hw, device=ctx.device)

    def old(x: torch.Tensor) -> torch.Tensor:
        acts = compress_triton.compress(x, layout, flag)
        init.copy_(bias.view(-1, 1, 1).expand(k, *g.out_hw))
        return conv_cuda.conv(acts, weights, tiled, init, relu=True)

    old_timing, old_out = _time_graphs([lambda x=x: old(x) for x in inputs], reps)
    ctx.add_timing(f"{name} old shared-memory kernel", old_timing)
    errors = {"old": _relative_error(old_out[-1], references[-1])}

    def register_variant(layer: register_cuda.RegisterConvLayer) -> list[Callable[[], Any]]:
        return [lambda x=x: register_cuda.conv(x, layer, bias, relu=True) for x in inputs]

    register_times: dict[str, float] = {}
    plan_rows = []
    for rank, plan in enumerate(_plans(g, weights.density, sms)):
        timing, outs = _time_graphs(register_variant(register_cuda.RegisterConvLayer.prepare(weights, plan)), reps)
        label = "register" if rank == 0 else f"register alt {rank}"
        ctx.add_timing(f"{name} {label}", timing)
        register_times[label] = timing.median_ms
        errors[label] = max(_relative_error(o, r) for o, r in zip(outs, references, strict=True))
        plan_rows.append(
            {
                "label": label,
                "layout": "pixel run" if plan.pixel_run else "tile",
                "ph_pw_kt_lanes_x_warps": [plan.ph, plan.pw, plan.kt, plan.lanes_x, plan.warps],
                "splits": plan.splits,
                "c_chunk": plan.c_chunk,
                "grid": list(plan.grid),
                "tile_hw": list(plan.tile_hw),
                "pitch": plan.pitch,
                "window_row_wavefronts": plan.window_row_wavefronts,
                "blocks_per_sm": plan.blocks_per_sm,
                "registers_estimate": plan.registers,
                "shared_bytes": plan.shared_bytes,
                "estimate_us": round(register_planner.estimate_us(plan, weights.density, sms), 1),
                "ms": round(timing.median_ms, 4),
            }
        )
    for variant, err in errors.items():
        ctx.add_value(f"{name} {variant}", "rel_err_vs_cudnn_fp32", err)
    best = min(register_times.values())
    measured = "; ".join(
        f"{r['label']} {r['layout']} {r['ph_pw_kt_lanes_x_warps']} x{r['splits']} {r['ms']} ms "
        f"(model {r['estimate_us']} us)"
        for r in plan_rows
    )
    print(f"{name}: cuDNN {cudnn.median_ms:.4f} ms, old {old_timing.median_ms:.4f}; {measured}")
    return {
        "layer": name,
        "weight_density": round(weights.density, 4),
        "activation_density": a_density,
        "cudnn_ms": round(cudnn.median_ms, 4),
        "old_ms": round(old_timing.median_ms, 4),
        "register_pick_ms": round(register_times["register"], 4),
        "register_best_ms": round(best, 4),
        "register_speedup_vs_cudnn": round(cudnn.median_ms / best, 3),
        "useful_tmacs_per_s": round(weights.nnz * g.out_hw[0] * g.out_hw[1] / best / 1e9, 2),
        "plans": plan_rows,
    }


def _plans(g: ConvGeometry, density: float, sms: int) -> list[register_tiling.RegisterTilePlan]:
    """The planner's pick and up to `ALTERNATES` more, each the best-predicted plan that varies one factor
    of the pick: its layout (1×1 layers: pixel runs or 2-D tiles), output channels per warp (kt), the pixel
    tile per lane (ph, pw), the channel splits and warps per block (so that the device shows what the cost
    model gets wrong)."""
    ranked = register_planner.candidates(g, density, sms)
    pick = ranked[0]
    chosen = [pick]
    for differs in (
        lambda p: p.pixel_run != pick.pixel_run,
        lambda p: p.kt != pick.kt,
        lambda p: p.kt == pick.kt and (p.ph, p.pw) != (pick.ph, pick.pw),
        lambda p: (
            (p.ph, p.pw, p.kt) == (pick.ph, pick.pw, pick.kt) and (p.splits, p.warps) != (pick.splits, pick.warps)
        ),
    ):
        plan = next((p for p in ranked if differs(p) and p not in chosen), None)
        if plan is not None:
            chosen.append(plan)
    return chosen[: 1 + ALTERNATES]


def _geometry_and_density(layer: Layer) -> tuple[ConvGeometry, float]:
    """A layer's geometry and the exact weight density `_pruned_weight` gives it (it keeps `keep` weights)."""
    _, g, w_density, _ = layer
    numel = g.out_channels * g.in_channels * g.kernel[0] * g.kernel[1]
    return g, max(1, round(w_density * numel)) / numel


def _profile_one_layer(ctx: Context, index: int, sms: int) -> None:
    """Launch layer `index`'s planner pick a few times, eagerly, for a profiler (`TENDRIL_NCU_LAYER`)."""
    _, g, w_density, a_density = _vgg16_layers()[index]
    c, k, size = g.in_channels, g.out_channels, g.in_hw[0]
    gen = torch.Generator().manual_seed(index)
    weights = SparseConvWeights.from_dense(_pruned_weight(g, w_density, gen).to(ctx.device), g)
    plan = _plans(g, weights.density, sms)[0]
    layer = register_cuda.RegisterConvLayer.prepare(weights, plan)
    x = _relu_like(c, size, a_density, gen).to(ctx.device)
    bias = torch.zeros(k, device=ctx.device)
    for _ in range(3):
        register_cuda.conv(x, layer, bias, relu=True)
    torch.cuda.synchronize()
    ctx.note(f"profiled conv{index + 1:02d}'s planner pick {plan} (3 launches)")


@register("sparse-conv-kernels", "VGG-16 conv layers: old SCNN kernel vs register-tiled kernel vs cuDNN fp32 (graphs)")
def run(ctx: Context) -> None:
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    reps = 20 if ctx.quick else 60
    sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
    if os.environ.get("TENDRIL_NCU_LAYER"):
        _profile_one_layer(ctx, int(os.environ["TENDRIL_NCU_LAYER"]), sms)
        return
    chosen = os.environ.get("SPARSE_CONV_LAYERS", "vgg16,resnet50_1x1").split(",")
    sets = {"vgg16": _vgg16_layers, "resnet50_1x1": _resnet50_1x1_layers}
    unknown = set(chosen) - set(sets)
    if unknown:
        raise ValueError(f"SPARSE_CONV_LAYERS names unknown layer sets {sorted(unknown)}; use {sorted(sets)}")
    layer_sets = {name: sets[name]() for name in chosen}
    started = time.perf_counter()
    plans = [
        p for layers in layer_sets.values() for layer in layers for p in _plans(*_geometry_and_density(layer), sms)
    ]
    compiled = register_cuda.precompile(plans)
    ctx.note(f"compiled {compiled} register-tiled kernels in {time.perf_counter() - started:.1f} s (parallel)")
    for set_name, layers in layer_sets.items():
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            results = [_bench_layer(ctx, layer, gen, reps, sms) for layer in layers]
        ctx.extra["layers" if set_name == "vgg16" else f"{set_name}_layers"] = results
        totals = _report_totals(ctx, set_name.replace("_", " "), results)
        if set_name == "vgg16":
            speedup = totals["cudnn"] / totals["register_best"]
            ctx.target("vgg16_conv_register_speedup_vs_cudnn_fp32", speedup, Goal(">", 1))
            ctx.target("vgg16_conv_register_speedup_vs_old", totals["old"] / totals["register_best"], Goal(">", 1))
    ctx.note(
        "old = Triton compression + init copy + shared-memory SCNN kernel (what a layer on it runs); register = "
        "register-tiled sparse-weight kernel on the dense input with bias+ReLU fused, its planner's pick and "
        f"{ALTERNATES} alternates (the sums take the best plan per layer); all inside CUDA graphs, fp32, TF32 off"
    )


def _report_totals(ctx: Context, label: str, results: list[dict[str, Any]]) -> dict[str, float]:
    """Sum one layer set's per-layer medians per variant into the results; returns the sums."""
    keys = ("cudnn", "old", "register_pick", "register_best")
    totals = {key: sum(layer[f"{key}_ms"] for layer in results) for key in keys}
    ctx.add_value(f"{label} conv layers cuDNN fp32", "sum_ms", totals["cudnn"])
    ctx.add_value(f"{label} conv layers old shared-memory kernel", "sum_ms", totals["old"])
    ctx.add_value(f"{label} conv layers register (planner pick)", "sum_ms", totals["register_pick"])
    ctx.add_value(f"{label} conv layers register (best plan per layer)", "sum_ms", totals["register_best"])
    ctx.add_value(
        f"{label} conv layers register (planner pick)",
        "speedup_vs_cudnn_fp32",
        totals["cudnn"] / totals["register_pick"],
    )
    ctx.add_value(
        f"{label} conv layers register (best plan per layer)",
        "speedup_vs_cudnn_fp32",
        totals["cudnn"] / totals["register_best"],
    )
    return totals
