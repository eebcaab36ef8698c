"""One-off probe: a decode loop's iteration against its step graph, from the same state (Llama-1B bf16 fused).

    PYTHONPATH=src:. python3 -m benchmarks.tools.probe_decode_loop  (OUT=dir for the JSON)
"""
import json, os, pathlib, statistics
import torch
from benchmarks.cases import decode_models
from tendril.generation import decode_step, generate
from tendril.graphs.capture import capture
from tendril.graphs.control import while_loop

def timed(fn, reps=7):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)

dev = torch.device("cuda")
model = decode_models.llama(dev, torch.bfloat16)
prompt = torch.randint(0, model.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0)).to(dev)
res = {}
for n in (1, 64, 128):
    call = lambda: generate(model, prompt, max_new_tokens=n, eos_token_id=[], pad_token_id=0, step="fused")
    call(); call()
    res[f"call_ms_{n}"] = timed(call, 11)
N = 128
state = decode_step(model, prompt, max_new_tokens=N, step="fused")
search = state.search
with torch.inference_mode():
    g = capture(state.step)
    def replays(k=126):
        state.reset()
        for _ in range(k):
            g.graph.replay()
    res["step_graph_us"] = timed(replays) * 1e3 / 126
    def unrolled_fn():
        for _ in range(18):
            state.step()
    state.reset()
    gu = capture(unrolled_fn, warmup=1)
    def unrolled():
        state.reset()
        for _ in range(7):
            gu.graph.replay()
    res["unrolled_us"] = timed(unrolled) * 1e3 / 126
    for label, cond in (("full", search.cond), ("lt_only", lambda s, q, u: s < N)):
        state.reset()
        gl = capture(lambda: while_loop(cond, search.body, state.buffers, max_iterations=N), warmup=1)
        state.reset()
        res[f"loop_{label}_us"] = timed(lambda: gl.graph.replay()) * 1e3 / (N - 1)
    state.reset()
    gt = capture(lambda: while_loop(search.cond, lambda s, q, u: (s + 1, q, u), state.buffers, max_iterations=N), warmup=1)
    state.reset()
    res["loop_tiny_body_us"] = timed(lambda: gt.graph.replay()) * 1e3 / (N - 1)
res["start_step"] = int(state.buffers[0].item())
print(json.dumps(res), flush=True)
pathlib.Path(os.environ.get("OUT", "."), "probe_loop2.json").write_text(json.dumps(res, indent=1))
