"""Does one persistent kernel stream a decode step's weights faster than a kernel per projection?

Llama-3.2-1B's projection chain at batch 1 (each layer's qkv, o_proj, gate_up and down, then the LM head; random
bf16 weights; no norm, activation, residual or attention, which the persistent kernel does not do), timed three
ways in one process, each replayed from a CUDA graph:
- `launches`: one `fused_linear` launch per projection (the decode step's kernel and default launches, with
  programmatic dependent launch where the GPU has it);
- `cublas`: `torch.nn.functional.linear` per projection;
- `persistent P, KxWxS`: `kernels.chain.ProjectionChain`, one kernel of P programs with K-deep tiles, W warps and
  an S-stage pipeline over each tile's K loop (P over the SM count: several programs per SM, trusted resident)
  (last: a kernel that hangs stops the run, and the others are written by then).
Per variant: µs per chain, GB/s (weight bytes over time), that over the device's read bandwidth measured in the
same process (`decode_roofline.read_bandwidth`), and the largest difference from `reference_chain` relative to
its largest value.

    PYTHONPATH=src:. python3 -m benchmarks.tools.gemv_chain --out OUT [--layers 16] [--programs 132,66]
        [--tiles 512x4x1,1024x8x3]

Writes OUT/gemv_chain.json and OUT/gemv_chain.md.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.cases.decode_roofline import read_bandwidth
from benchmarks.tools.profile_generation import _graph_time_us
from tendril.generation.kernels import linear
from tendril.generation.kernels.chain import ProjectionChain, reference_chain
from tendril.generation.kernels.layers import Projection

LAYER = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
"""[out, in] of a Llama-3.2-1B layer's projections: qkv, o_proj, gate_up (both halves), down."""
HEAD = (128256, 2048)


def chain_shapes(layers: int) -> list[tuple[int, int]]:
    return LAYER * layers + [HEAD]


def measure(layers: int, programs: list[int], tiles: list[tuple[int, int, int]], out: Path) -> dict[str, Any]:
    device, dtype = torch.device("cuda"), torch.bfloat16
    generator = torch.Generator(device=device).manual_seed(0)
    shapes = chain_shapes(layers)
    chain = ProjectionChain([torch.empty(o, i, dtype=dtype, device=device) for o, i in shapes])
    weights, offset = [], 0
    for o, i in shapes:  # views of the chain's own buffer: every variant reads the same bytes
        w = chain.weights[offset : offset + o * i].view(o, i)
        w.copy_(torch.randn(o, i, generator=generator, device=device, dtype=torch.float32) / i**0.5)
        weights.append(w)
        offset += o * i
    x = torch.randn(shapes[0][1], generator=generator, device=device).to(dtype)
    expected = reference_chain(weights, x).float()
    projections = [Projection((w,), (None,)) for w in weights]

    def launches() -> torch.Tensor:
        y = x[None]
        for projection, w in zip(projections, weights, strict=True):
            y = linear.fused_linear(y[:, : w.shape[1]], projection)
        return y[0]

    def cublas() -> torch.Tensor:
        y = x[None]
        for w in weights:
            y = F.linear(y[:, : w.shape[1]], w)
        return y[0]

    bandwidth = read_bandwidth(device)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": layers,
                              "weight_bytes": chain.bytes_read, "read_bandwidth_gb_per_s": bandwidth / 1e9,
                              "sm_count": torch.cuda.get_device_properties(device).multi_processor_count,
                              "variants": []}
    variants: list[tuple[str, Callable[[], torch.Tensor]]] = [("launches", launches), ("cublas", cublas)]
    sm_count = report["sm_count"]
    variants += [(f"persistent {p}, {k}x{w}x{s}", lambda p=p, k=k, w=w, s=s: chain.run(
        x, p, block_k=k, num_warps=w, stages=s, per_sm=-(-p // sm_count))) for p in programs for k, w, s in tiles]
    for name, fn in variants:
        print(f"{name} ...", flush=True)
        got = fn().float()
        us = _graph_time_us(lambda _, run=fn: run(), 1, launches=1, reps=20)
        report["variants"].append({
            "variant": name, "us_per_chain": us, "gb_per_s": chain.bytes_read / us / 1e3,
            "bandwidth_fraction": chain.bytes_read / (us * 1e-6) / bandwidth,
            "max_rel_diff": float((got - expected).abs().max() / expected.abs().max()),
        })  # fmt: skip
        print(json.dumps(report["variants"][-1]), flush=True)
        (out / "gemv_chain.json").write_text(json.dumps(report, indent=1))
    return report


def markdown(report: dict[str, Any]) -> str:
    lines = ["# A decode step's projection chain: one persistent kernel against a launch per projection", "",
             f"- device: {report['device']}; torch {report['torch']}; Llama-3.2-1B's shapes, {report['layers']} "
             f"layers and the LM head, bf16, batch 1: {report['weight_bytes'] / 1e9:.3f} GB of weights; read "
             f"bandwidth {report['read_bandwidth_gb_per_s']:.0f} GB/s; {report['sm_count']} SMs", "",
             "| variant | µs per chain | GB/s | of read bandwidth | max rel diff |", "|---|---:|---:|---:|---:|"]
    for v in report["variants"]:
        lines.append(f"| {v['variant']} | {v['us_per_chain']:.1f} | {v['gb_per_s']:.0f} | "
                     f"{v['bandwidth_fraction']:.3f} | {v['max_rel_diff']:.2e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--programs", default="", help="comma-separated persistent grids (default: one per SM)")
    parser.add_argument("--tiles", default="512x4x1,1024x8x1,2048x8x1,1024x8x3",
                        help="comma-separated tile depth x warps x pipeline stages of the persistent kernel")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    programs = [int(p) for p in args.programs.split(",") if p] or [sm_count]
    tiles = [(int(k), int(w), int(s)) for k, w, s in (tile.split("x") for tile in args.tiles.split(","))]
    report = measure(args.layers, programs, tiles, args.out)
    (args.out / "gemv_chain.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
