"""One-off probe: Llama-1B's LM head and greedy choice. As is (fused_linear, RMSNorm to float32 logits, then the chunk
argmax and greedy kernels) against a persistent LM head keeping per-program (max, first index) partials that the greedy
kernel merges; each chain captured ten times in a CUDA graph and replayed, µs a chain (best of five)."""
import json

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import argmax_kernel as ak
from tendril.generation.kernels.layers import Norm, Projection
from tendril.generation.kernels.linear import fused_linear


@triton.jit
def _head_argmax(x_ptr, gain_ptr, eps, w_ptr, stride_wn, N, K, best_ptr, index_ptr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    DTYPE = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    offs_n = tl.arange(0, BLOCK_N)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    cols = pid * BLOCK_N + offs_n
    w = tl.load(w_ptr + cols[:, None] * stride_wn + offs_k[None, :], mask=(cols < N)[:, None] & k_mask[None, :],
                other=0.0)
    gain = tl.load(gain_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / K + eps)
    xn = (x * rstd).to(DTYPE).to(tl.float32)
    xn = (xn * gain).to(DTYPE).to(tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 2147483647, tl.int32)
    for start in range(pid * BLOCK_N, N, programs * BLOCK_N):
        cols = start + offs_n
        nxt = cols + programs * BLOCK_N
        w_next = tl.load(w_ptr + nxt[:, None] * stride_wn + offs_k[None, :], mask=(nxt < N)[:, None] & k_mask[None, :],
                         other=0.0)
        y = tl.sum(w.to(tl.float32) * xn[None, :], axis=1).to(DTYPE).to(tl.float32)
        y = tl.where(y != y, float("inf"), y)
        y = tl.where(cols < N, y, float("-inf"))
        top = tl.max(y, axis=0)
        first = tl.min(tl.where(y == top, cols, 2147483647), axis=0)
        better = (top > best) | ((top == best) & (first < best_index))
        best = tl.where(better, top, best)
        best_index = tl.where(better, first, best_index)
        w = w_next
    tl.store(best_ptr + pid, best)
    tl.store(index_ptr + pid, best_index)


def graph_time(fn, reps=200):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        for _ in range(reps // 10):
            g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / reps)
    return min(times)


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    dtype = torch.bfloat16
    V, K = 128256, 2048
    head = torch.nn.Linear(K, V, bias=False, device=dev, dtype=dtype)
    torch.nn.init.normal_(head.weight, std=0.02)
    proj = Projection.of(head)
    gain = (1 + 0.1 * torch.randn(K, device=dev)).to(dtype)
    norm = Norm("rms", gain, None, 1e-5)
    x = torch.randn(1, K, device=dev, dtype=dtype)
    logits = torch.empty(1, V, device=dev, dtype=torch.float32)
    step = torch.zeros((), dtype=torch.long, device=dev)
    seq = torch.zeros(1, 256, dtype=torch.long, device=dev)
    unf = torch.ones(1, dtype=torch.bool, device=dev)
    eos = torch.tensor([2], device=dev)
    res = {}

    def current():
        fused_linear(x, proj, norm=norm, out=logits)
        return ak.greedy_choice(logits, step, seq, unf, eos, 0, 16, 100)

    def head_only():
        fused_linear(x, proj, norm=norm, out=logits)

    head.weight.requires_grad_(False)
    ref_token = current()[3].item()
    res["current_us"] = graph_time(current)
    res["head_only_us"] = graph_time(head_only)
    wsum = torch.empty((), device=dev, dtype=torch.float32)
    weights = head.weight.detach()
    res["read_weights_sum_us"] = graph_time(lambda: torch.sum(weights, dim=(0, 1), dtype=torch.float32, out=wsum))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for per_sm in (1, 2, 4, 8):
        for block_n, warps in ((4, 4), (8, 8), (4, 8), (2, 4), (8, 4)):
            P = sms * per_sm
            best = torch.empty(1, P, device=dev, dtype=torch.float32)
            index = torch.empty(1, P, device=dev, dtype=torch.int32)
            tokens = torch.empty(1, dtype=torch.long, device=dev)
            new_seq, new_unf, new_step = torch.empty_like(seq), torch.empty_like(unf), torch.empty_like(step)
            running = torch.empty((), dtype=torch.bool, device=dev)

            def candidate(P=P, best=best, index=index, block_n=block_n, warps=warps, tokens=tokens, new_seq=new_seq,
                          new_unf=new_unf, new_step=new_step, running=running):
                _head_argmax[(P,)](x, gain, 1e-5, head.weight, head.weight.stride(0), V, K, best, index,
                                   BLOCK_N=block_n, BLOCK_K=triton.next_power_of_2(K), PDL=True, num_warps=warps,
                                   launch_pdl=True)
                ak._greedy_kernel[(1,)](best, index, P, step, seq, seq.shape[1], unf.view(torch.int8), eos, 1, 0, 16,
                                        100, tokens, new_seq, new_unf.view(torch.int8), new_step,
                                        running.view(torch.int8), CHUNKS=triton.next_power_of_2(P), COPY=256,
                                        HAS_EOS=True, ONE_ROW=True, PDL=True, num_warps=4, launch_pdl=True)
                return tokens
            try:
                tok = candidate().item()
                t = graph_time(candidate)
            except Exception as e:
                res[f"P{per_sm}x_n{block_n}_w{warps}"] = repr(e)[:200]
                continue
            res[f"P{per_sm}x_n{block_n}_w{warps}"] = {"us": t, "token_ok": tok == ref_token}
            print(per_sm, block_n, warps, t, tok == ref_token, flush=True)
    print(json.dumps(res, indent=1))


main()
