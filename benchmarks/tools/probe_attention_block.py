"""One-off probe: decode attention's slot block vs the cache length (Llama-1B bf16, GPT-2 fp16).

    PYTHONPATH=src:. python3 -m benchmarks.tools.probe_attention_block  (OUT=dir for the JSON)
"""
import json, os, pathlib, statistics
import torch
from benchmarks.cases import decode_models
from benchmarks.cases import generation as case
from tendril.generation import generate
from tendril.generation.api import release_graphs
from tendril.generation.kernels import attention

def timed(fn, reps=7):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)

results = {"micro": [], "e2e": []}
dev = torch.device("cuda")
for name, heads, kv, dtype, rot in (("llama", 32, 8, torch.bfloat16, True), ("gpt2", 12, 12, torch.float16, False)):
    for max_len in (144, 272):
        d = 64
        keys = torch.randn(1, kv, max_len, d, device=dev, dtype=dtype)
        values = torch.randn_like(keys)
        valid = torch.ones(1, max_len, dtype=torch.bool, device=dev)
        q = torch.randn(1, heads * d, device=dev, dtype=dtype)
        k = torch.randn(1, kv * d, device=dev, dtype=dtype)
        v = torch.randn(1, kv * d, device=dev, dtype=dtype)
        cos = torch.randn(1, d, device=dev, dtype=dtype); sin = torch.randn(1, d, device=dev, dtype=dtype)
        rotary = ("half", cos, sin) if rot else None
        out = torch.empty(1, heads * d, device=dev, dtype=dtype)
        for slot_i in (20, max_len // 2, max_len - 2):
            slot = torch.tensor(slot_i, device=dev)
            for bs in (32, 64, 128, 256):
                for w in (2, 4, 8):
                    f = lambda: attention.decode_attention(q, k, v, keys, values, valid, slot, 0.125, rotary, out=out,
                                                           block_s=bs, num_warps=w, pdl=False)
                    f(); torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        for _ in range(20):
                            f()
                    us = timed(lambda: g.replay()) * 1e3 / 20
                    results["micro"].append(dict(model=name, max_len=max_len, slot=slot_i, block_s=bs, warps=w, us=us))
        print(json.dumps([r for r in results["micro"] if r["model"] == name and r["max_len"] == max_len]), flush=True)

default_warps = attention.decode_attention.__kwdefaults__["num_warps"]
for name, build in (("llama1b", lambda: decode_models.llama(dev, torch.bfloat16)), ("gpt2", lambda: case.gpt2(dev))):
    model = build()
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(dev)
    for max_block, warps in ((256, 4), (128, 4), (64, 4), (256, 8), (128, 8), (64, 8)):
        attention.MAX_BLOCK_S = max_block
        attention.decode_attention.__kwdefaults__["num_warps"] = warps
        row = dict(model=name, max_block_s=max_block, warps=warps)
        for n in (1, 128):
            release_graphs(model)
            call = lambda: generate(model, prompt, max_new_tokens=n, eos_token_id=[], pad_token_id=0, step="fused")
            call(); call()
            row[f"ms_{n}"] = timed(call, 9)
        row["iter_us"] = (row["ms_128"] - row["ms_1"]) / 127 * 1e3
        results["e2e"].append(row)
        print(json.dumps(row), flush=True)
    attention.MAX_BLOCK_S = 256
    attention.decode_attention.__kwdefaults__["num_warps"] = default_warps
    del model
    torch.cuda.empty_cache()
pathlib.Path(os.environ.get("OUT", "."), "probe_attn.json").write_text(json.dumps(results, indent=1))
