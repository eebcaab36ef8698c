"""Demo: a pruned CNN run by tendril's sparse×sparse engine against dense PyTorch.

A VGG-style network (random weights pruned to `WEIGHT_DENSITY`, the 90% sparsity the engines target; ReLU
activations) is pruned, converted with `tendril.sparse.convert`, and run on the same input: on a GPU, dense
cuDNN fp32 and tendril's engine each replayed as one CUDA graph; on the CPU, dense PyTorch against
tendril's CPU implementation of the same sparse algorithm. Every tendril row is checked against
dense PyTorch on the same pruned weights.
"""

from __future__ import annotations

import torch
from torch import nn

from tendril.demo import DemoSection, Row, SectionResult
from tendril.graphs.capture import capture
from tendril.sparse import convert, prune
from tendril.utils.timing import time_callable

WEIGHT_DENSITY = 0.1


def _vgg_style(width: int) -> nn.Module:
    layers: list[nn.Module] = []
    channels = 3
    for out in (width, width, 2 * width, 2 * width, 4 * width, 4 * width):
        layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU(inplace=True)]
        if out != channels and out != width:
            layers.append(nn.MaxPool2d(2))
        channels = out
    layers += [nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(channels * 16, 256), nn.ReLU(), nn.Linear(256, 10)]
    return nn.Sequential(*layers)


def run(device: torch.device, quick: bool) -> SectionResult:
    torch.manual_seed(0)
    if device.type == "cuda":
        size, width = 112, 64
    else:
        size, width = (32, 8) if quick else (64, 16)
    model = _vgg_style(width).eval().to(device)
    prune(model, WEIGHT_DENSITY)
    x = torch.randn(1, 3, size, size, device=device)
    reps = 3 if quick else 30
    net = convert(model, x)
    notes = []
    with torch.no_grad():
        reference = model(x)
        err = float((net(x) - reference).abs().max() / reference.abs().max())
        check = f"rel err {err:.1e} vs dense"
        if device.type == "cuda":
            previous = torch.backends.cudnn.allow_tf32
            torch.backends.cudnn.allow_tf32 = False
            dense = capture(model, x.clone())
            torch.backends.cudnn.allow_tf32 = previous
            sparse = capture(net, x.clone())
            dense_t = time_callable(dense.graph.replay, device=device, warmup=3, reps=reps)
            sparse_t = time_callable(sparse.graph.replay, device=device, warmup=3, reps=reps)
            rows = [
                Row("dense cuDNN fp32, CUDA graph", f"VGG-style, {size}x{size}", dense_t.median_ms, baseline=True),
                Row(
                    "tendril sparse×sparse, CUDA graph",
                    "30% weights, ReLU activations",
                    sparse_t.median_ms,
                    check=check,
                ),
            ]
        else:
            net.set_backend("cpu", torch.get_num_threads())
            dense_t = time_callable(model, [(x,)], warmup=1, reps=reps)
            sparse_t = time_callable(net, [(x,)], warmup=1, reps=reps)
            rows = [
                Row("dense PyTorch (CPU)", f"VGG-style, {size}x{size}", dense_t.median_ms, baseline=True),
                Row("tendril sparse (CPU)", "compiled (numba) CPU engine", sparse_t.median_ms, check=check),
            ]
            notes.append(
                "The GPU kernels (CUDA C++ via NVRTC, Triton) need an NVIDIA GPU: only the CPU engine ran here."
            )
    layers = net.layers()
    densities = ", ".join(f"{r.weight_density:.2f}/{r.activation_density:.2f}" for r in layers)
    compressed, dense_bytes = net.release_unused_kernels().weight_bytes()
    notes.append(f"per-layer weight/activation density: {densities}")
    notes.append(
        f"weights: {compressed / 2**20:.2f} MiB as the chosen kernels hold them vs {dense_bytes / 2**20:.2f} MiB dense"
    )
    return SectionResult("Sparse CNN inference (cuSCNN)", rows, notes)


SECTION = DemoSection(order=40, title="Sparse CNN inference (cuSCNN)", run=run)
