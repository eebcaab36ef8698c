"""One-off: one-row projections of Llama-1B (bf16) and GPT-2 (fp16) at chosen launch configurations (after the
kernel holds only the tiles a share has), beside the default launch and the streaming floor of the same bytes.
GPT-2's Conv1D projections are also timed with their weights in nn.Linear's layout (K contiguous)."""
import json
import os
import sys

import torch

from benchmarks.tools import decode_chain_floor as floor
from benchmarks.tools import profile_generation as pg
from tendril.generation.kernels import launch, linear
from tendril.generation.kernels.layers import Norm, Projection

device = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count
FIRST = {  # the first run (`first`): the kernel holding only the tiles a share has, the rule unchanged
    "norm+qkv": "8x1024x4,4x2048x4,8x2048x8,16x1024x8,4x1024x4,16x512x4,2x2048x4,8x1024x8",
    "o_proj+res": "8x2048x4,4x2048x4,8x1024x4,8x2048x8,16x2048x8,2x2048x4,16x1024x8,4x1024x4",
    "norm+gate_up": "4x1024x4,2x2048x4,4x2048x8,8x1024x8,2x1024x4,8x512x4,4x2048x4,1x2048x4",
    "down_proj+res": "8x2048x4,4x2048x4,8x1024x4,16x512x4,8x2048x8,2x4096x4,4x4096x8,16x1024x8,4x1024x4,1x8192x4",
    "norm+lm_head": "16x512x4,8x1024x4,8x2048x8,4x2048x4,16x1024x8,32x256x4,8x512x4",
    "ln_1+c_attn": "8x1024x4,16x1024x8,4x1024x4,16x256x4,32x256x4,16x1024x4,8x1024x8",
    "attn.c_proj+res": "8x1024x4,16x1024x8,4x1024x4,16x256x4,32x256x4,16x1024x4,2x1024x4",
    "ln_2+c_fc+gelu": "8x1024x4,16x1024x8,4x1024x4,16x256x4,32x256x4,16x1024x4",
    "mlp.c_proj+res": "4x4096x4,8x1024x4,16x1024x8,4x1024x4,8x4096x8,2x4096x4,16x512x4",
    "ln_f+lm_head": "32x256x4,16x256x4,8x1024x4,16x1024x8,8x512x4,4x1024x4",
}
SECOND = {  # the second run (`second`): the new rule's picks (the default) beside the first run's best
    "norm+qkv": "8x1024x4,8x2048x4,8x2048x8",
    "o_proj+res": "4x2048x4,8x2048x4",
    "norm+gate_up": "4x2048x4,4x1024x4",
    "down_proj+res": "2x4096x4,1x8192x4,2x8192x4,2x8192x8",
    "norm+lm_head": "8x1024x4,16x512x4",
    "ln_f+lm_head": "32x256x4,8x1024x4,16x1024x4,16x256x4",
}
RUN = sys.argv[1]
CONFIGS = FIRST if RUN == "first" else SECOND


def time_shape(label, out_f, in_f, layout, norm_kind, act, residual, gated, dtype, configs, has_bias):
    seg = 2 if gated else 1
    copies = max(2, min(64, -(-160 * 2**20 // (seg * out_f * in_f * 2))))
    projections = []
    for _ in range(copies):
        w = torch.randn(seg * out_f, in_f, device=device, dtype=dtype) * 0.02
        if layout == "conv1d":
            w = w.t().contiguous().t()
        bias = None if not has_bias else torch.randn(seg * out_f, device=device, dtype=dtype) * 0.02
        projections.append(Projection(w.split(out_f), (None,) * seg if bias is None else bias.split(out_f)))
    x = torch.randn(1, in_f, device=device, dtype=dtype)
    nb = torch.randn(in_f, device=device, dtype=dtype) * 0.1 if norm_kind == "layer" else None
    norm = None if norm_kind is None else Norm(norm_kind, 1 + 0.1 * torch.randn(in_f, device=device, dtype=dtype), nb, 1e-5)
    addends = (torch.randn(1, out_f, device=device, dtype=dtype),) if residual else ()
    out = torch.empty(1, out_f, device=device, dtype=dtype)
    expected = linear.fused_linear(x, projections[0], norm=norm, activation=act, addends=addends, gated=gated, block_n=16, block_k=128, split_k=1, num_warps=4)
    d = launch.launch_config(seg * out_f, in_f, 1, k_contiguous=layout == "linear", sm_count=sms, normed=norm is not None, matrices=seg)
    entry = {"shape": label, "layout": layout, "default": f"{d.block_n}x{d.block_k}x{d.num_warps} split={d.split_k}", "us": {}}
    def run(i, **kw):
        return linear.fused_linear(x, projections[i], norm=norm, activation=act, addends=addends, gated=gated, out=out, **kw)
    entry["us"]["default"] = round(pg._graph_time_us(run, copies), 3)
    for c in configs.split(","):
        bn, bk, w = map(int, c.split("x"))
        try:
            entry["us"][c] = round(pg._graph_time_us(lambda i: run(i, block_n=bn, block_k=bk, split_k=1, num_warps=w), copies), 3)
            run(0, block_n=bn, block_k=bk, split_k=1, num_warps=w)
            diff = float((out.float() - expected.float()).abs().max())
            if diff > 0.05:
                entry["us"][c + "_diff"] = diff
        except Exception as e:
            entry["us"][c] = f"ERR {type(e).__name__}: {str(e)[:80]}"
    nbytes = seg * out_f * in_f * 2
    best = None
    for warps, vectors in floor.CONFIGS:
        chain = floor.Chain([nbytes] * 24, warps, vectors, True, device)
        us = floor.graph_us(chain, 10, 7) / 24
        best = us if best is None else min(best, us)
        del chain
        torch.cuda.empty_cache()
    entry["us"]["floor"] = round(best, 3)
    print(entry, flush=True)
    return entry


results = []
for model, dtype in (("llama1b", torch.bfloat16), ("gpt2", torch.float16)):
    for label, out_f, in_f, layout, norm_kind, act, residual, *rest in pg.SWEEP_SHAPES[model]:
        gated = bool(rest and rest[0])
        layouts = (("conv1d", "linear") if RUN == "first" else ()) if layout == "conv1d" else (layout,)
        for lay in layouts:
            configs = CONFIGS[label] if lay == "linear" else ""
            results.append(time_shape(label, out_f, in_f, lay, norm_kind, act, residual, gated, dtype,
                                      configs if configs else "16x256x4", model == "gpt2" and "lm_head" not in label))
        torch.cuda.empty_cache()
json.dump(results, open(os.path.join(os.environ["OUT"], f"probe_configs_{RUN}.json"), "w"), indent=1)
