"""One-off: Llama-1B's one-row projections at the default launch, with parts of the kernel's work taken away
(norm; norm, activation and residual; PDL), beside the streaming floor of the same bytes."""
import json
import os
import sys

import torch

from benchmarks.tools import decode_chain_floor as floor
from benchmarks.tools import profile_generation as pg
from tendril.generation.kernels import launch, linear
from tendril.generation.kernels.layers import Norm, Projection

tag = sys.argv[1]
device, dtype = torch.device("cuda"), torch.bfloat16
sms = torch.cuda.get_device_properties(0).multi_processor_count
results = []
for label, out_f, in_f, layout, norm_kind, act, residual, *rest in pg.SWEEP_SHAPES["llama1b"]:
    gated = bool(rest and rest[0])
    seg = 2 if gated else 1
    copies = max(2, min(64, -(-160 * 2**20 // (seg * out_f * in_f * 2))))
    projections = [Projection((torch.randn(seg * out_f, in_f, device=device, dtype=dtype) * 0.02).split(out_f),
                              (None,) * seg) for _ in range(copies)]
    x = torch.randn(1, in_f, device=device, dtype=dtype)
    norm = None if norm_kind is None else Norm(norm_kind, torch.ones(in_f, device=device, dtype=dtype), None, 1e-5)
    addends = (torch.randn(1, out_f, device=device, dtype=dtype),) if residual else ()
    out = torch.empty(1, out_f, device=device, dtype=dtype)
    cfg = launch.launch_config(seg * out_f, in_f, 1, k_contiguous=True, sm_count=sms, normed=norm is not None,
                               matrices=seg)
    base = dict(block_n=cfg.block_n, block_k=cfg.block_k, split_k=cfg.split_k, num_warps=cfg.num_warps)
    variants = {
        "default": dict(norm=norm, activation=act, addends=addends),
        "no_norm": dict(norm=None, activation=act, addends=addends),
        "bare": dict(norm=None, activation="none", addends=()),
        "no_pdl": dict(norm=norm, activation=act, addends=addends, pdl=False),
        "warps8": dict(norm=norm, activation=act, addends=addends, num_warps=8),
        "warps2": dict(norm=norm, activation=act, addends=addends, num_warps=2),
    }
    entry = {"shape": label, "config": base, "us": {}}
    for name, kw in variants.items():
        args = {**base, **kw}
        entry["us"][name] = round(pg._graph_time_us(
            lambda i, a=args: linear.fused_linear(x, projections[i], gated=gated, out=out, **a), copies), 3)
    nbytes = seg * out_f * in_f * 2
    best = None
    for warps, vectors in floor.CONFIGS:
        chain = floor.Chain([nbytes] * 24, warps, vectors, True, device)
        us = floor.graph_us(chain, 10, 7) / 24
        best = us if best is None else min(best, us)
        del chain
        torch.cuda.empty_cache()
    entry["us"]["floor"] = round(best, 3)
    results.append(entry)
    print(tag, label, base, entry["us"], flush=True)
    del projections
    torch.cuda.empty_cache()
json.dump(results, open(os.path.join(os.environ["OUT"], f"probe_ablate_{tag}.json"), "w"), indent=1)
