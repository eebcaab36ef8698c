"""One-off probe: batch-1 projections of Llama-1B's shapes (bf16), cuBLAS vs tendril's fused_linear vs a GEMV
whose weight tiles come through TMA descriptors in a multi-stage pipeline (and the same loop with pointer loads).
Each timed in CUDA graphs of 16 launches rotating over weight copies larger than L2 together."""

import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from tendril.generation.kernels.layers import Projection
from tendril.generation.kernels.linear import fused_linear


@triton.jit
def gemv_tma(desc, x_ptr, out_ptr, K, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
             STAGES: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n0 = pid * BLOCK_N
    share = K // SPLIT
    k_begin = split * share
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_begin, k_begin + share, BLOCK_K, num_stages=STAGES):
        w = desc.load([n0, k])
        x = tl.load(x_ptr + k + tl.arange(0, BLOCK_K))
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    offs = n0 + tl.arange(0, BLOCK_N)
    if SPLIT == 1:
        tl.store(out_ptr + offs, acc, mask=offs < N)
    else:
        tl.atomic_add(out_ptr + offs, acc, mask=offs < N, sem="relaxed")


@triton.jit
def gemv_ptr(w_ptr, x_ptr, out_ptr, K, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
             STAGES: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    n0 = pid * BLOCK_N
    share = K // SPLIT
    k_begin = split * share
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.range(k_begin, k_begin + share, BLOCK_K, num_stages=STAGES):
        offs_k = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :], mask=(offs_n < N)[:, None], other=0.0)
        x = tl.load(x_ptr + offs_k)
        acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    if SPLIT == 1:
        tl.store(out_ptr + offs_n, acc, mask=offs_n < N)
    else:
        tl.atomic_add(out_ptr + offs_n, acc, mask=offs_n < N, sem="relaxed")


def alloc(size, align, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def graph_us(fns, launches=16, reps=30):
    """Median µs per launch of a graph of `launches` calls (fns rotate over weight copies)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    times.sort()
    return times[len(times) // 2]


def main():
    torch.manual_seed(0)
    dev = "cuda"
    dt = torch.bfloat16
    shapes = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
              "lm_head": (128256, 2048)}
    only = sys.argv[1].split(",") if len(sys.argv) > 1 else list(shapes)
    results = {}
    for name in only:
        n, k = shapes[name]
        copies = max(2, -(-200 * 2**20 // (n * k * 2)))
        ws = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device=dev, dtype=dt)
        ref = (x.float() @ ws[0].float().t()).squeeze(0)
        row = {"bytes": n * k * 2}
        outs = [torch.empty(1, n, device=dev, dtype=dt) for _ in ws]
        row["cublas"] = graph_us([lambda w=w, o=o: torch.matmul(x, w.t(), out=o) for w, o in zip(ws, outs)])
        projs = [Projection((w,), (None,)) for w in ws]
        row["fused_linear"] = graph_us([lambda p=p, o=o: fused_linear(x, p, out=o) for p, o in zip(projs, outs)])
        err = (fused_linear(x, projs[0]).float().squeeze(0) - ref).abs().max().item()
        row["fused_linear_err"] = err
        out32 = torch.zeros(n, device=dev, dtype=torch.float32)
        best = {}
        for kind, bn, bk, st, warps, split in itertools.product(
            ("tma", "ptr"), (16, 32, 64), (128, 256), (3, 5), (4, 8), (1, 2, 4) if k >= 4096 else (1, 2)
        ):
            if bn * bk * 2 * st > 200 * 1024 or k % (split * bk):
                continue
            grid = (triton.cdiv(n, bn), split)
            try:
                if kind == "tma":
                    descs = [TensorDescriptor.from_tensor(w, [bn, bk]) for w in ws]
                    fns = [lambda d=d: gemv_tma[grid](d, x, out32, k, n, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                                                       STAGES=st, num_warps=warps) for d in descs]
                else:
                    fns = [lambda w=w: gemv_ptr[grid](w, x, out32, k, n, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split,
                                                       STAGES=st, num_warps=warps) for w in ws]
                out32.zero_()
                fns[0]()
                torch.cuda.synchronize()
                e = (out32 - ref).abs().max().item()
                us = graph_us(fns)
            except Exception as exc:  # noqa: BLE001
                print(name, kind, bn, bk, st, warps, split, "failed", repr(exc)[:200], flush=True)
                continue
            key = f"{kind} n{bn} k{bk} s{st} w{warps} split{split}"
            row[key] = us
            if split == 1 and e > 1e-2 * ref.abs().max().item():
                row[key + " err"] = e
            if kind not in best or us < best[kind][1]:
                best[kind] = (key, us)
        row["best"] = best
        results[name] = row
        gbs = {k2: row["bytes"] / v / 1e3 for k2, v in (("cublas", row["cublas"]), ("fused", row["fused_linear"]))}
        print(name, f"cublas {row['cublas']:.2f} fused {row['fused_linear']:.2f}",
              {kk: f"{vv[1]:.2f} {vv[0]}" for kk, vv in best.items()}, gbs, flush=True)
    out = sys.argv[2] if len(sys.argv) > 2 else "probe_gemv.json"
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    triton.set_allocator(alloc)
    main()
