"""One-off probe: decode step time vs the attention kernel's slot block, per tree (PYTHONPATH picks the tree).

    PYTHONPATH=<tree>/src:. python3 -m benchmarks.tools.probe_attention_block_ab NAME 256,128 [1,2,3,8,16]  (largest blocks; new-token counts to time; OUT=dir)
"""
import json, os, pathlib, statistics, sys
import torch
from benchmarks.cases import decode_models
from benchmarks.cases import generation as case
from tendril.generation import decode_step, generate
from tendril.generation.api import release_graphs
from tendril.generation.kernels import attention
from tendril.graphs.capture import capture

tree = sys.argv[1]
blocks = [int(b) for b in sys.argv[2].split(",")]
lengths = [int(n) for n in sys.argv[3].split(",")] if len(sys.argv) > 3 else []

def timed(fn, reps=7):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)

dev = torch.device("cuda")
rows = []
for name, build in (("llama1b", lambda: decode_models.llama(dev, torch.bfloat16)), ("gpt2", lambda: case.gpt2(dev))):
    model = build()
    prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(dev)
    for block in blocks:
        attention.MAX_BLOCK_S = block
        release_graphs(model)
        state = decode_step(model, prompt, max_new_tokens=128, step="fused")
        with torch.inference_mode():
            g = capture(state.step)
        def replays(k=120):
            state.reset()
            for _ in range(k):
                g.graph.replay()
        row = dict(tree=tree, model=name, max_block_s=block, step_graph_us=timed(replays, 7) * 1e3 / 120)
        for n in (1, 128):
            call = lambda: generate(model, prompt, max_new_tokens=n, eos_token_id=[], pad_token_id=0, step="fused")
            call(); call()
            row[f"ms_{n}"] = timed(call, 11)
        row["iter_us"] = (row["ms_128"] - row["ms_1"]) / 127 * 1e3
        rows.append(row)
        print(json.dumps(row), flush=True)
        del state, g
    attention.MAX_BLOCK_S = 256
    release_graphs(model)
    for n in lengths:
        call = lambda: generate(model, prompt, max_new_tokens=n, eos_token_id=[], pad_token_id=0, step="fused")
        call(); call()
        row = dict(tree=tree, model=name, new_tokens=n, ms=timed(call, 11))
        rows.append(row)
        print(json.dumps(row), flush=True)
    del model
    torch.cuda.empty_cache()
pathlib.Path(os.environ.get("OUT", "."), f"probe_block_{tree}.json").write_text(json.dumps(rows, indent=1))
