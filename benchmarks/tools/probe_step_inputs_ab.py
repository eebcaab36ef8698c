"""One-off probe: decode step graph, calls of several lengths, and a streamed call's iterations (device stamps), per tree.

    PYTHONPATH=<tree>/src:. python3 -m benchmarks.tools.probe_step_inputs_ab NAME  (OUT=dir; a tree: `git archive REV src`)
"""
import json, os, pathlib, statistics, sys
import torch
from benchmarks.cases import decode_models
from benchmarks.cases import generation as case
from tendril.generation import decode_step, generate
from tendril.generation.api import release_graphs
from tendril.graphs.capture import capture

tree = sys.argv[1]


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
    row = dict(tree=tree, model=name)
    state = decode_step(model, prompt, max_new_tokens=128, step="fused")
    with torch.inference_mode():
        g = capture(state.step)

    def replays(k=120):
        state.reset()
        for _ in range(k):
            g.graph.replay()
    row["step_graph_us"] = timed(replays, 7) * 1e3 / 120
    del state, g
    calls = {}
    for n in (1, 2, 8, 32, 64, 128):
        call = lambda n=n: generate(model, prompt, max_new_tokens=n, eos_token_id=[], pad_token_id=0, step="fused")
        call(); call()
        calls[n] = call
        row[f"ms_{n}"] = timed(call, 11)
    row["iter_us_64_128"] = (row["ms_128"] - row["ms_64"]) / 64 * 1e3
    row["iter_us_1_128"] = (row["ms_128"] - row["ms_1"]) / 127 * 1e3
    row["iter_us_2_32"] = (row["ms_32"] - row["ms_2"]) / 30 * 1e3
    print(json.dumps(row), flush=True)
    from benchmarks.cases.generation_streaming import StampingStreamer, _ring
    streamed = lambda: generate(model, prompt, max_new_tokens=128, eos_token_id=[], pad_token_id=0, step="fused",
                                streamer=StampingStreamer())
    streamed(); streamed()
    per = []
    for _ in range(5):
        streamed()
        torch.cuda.synchronize()
        ring = _ring(model)
        stamps = [ring.stamp(c) for c in range(1, 129)]
        per.append([(b - a) / 1e3 for a, b in zip(stamps, stamps[1:])])
    iters = [statistics.median(col) for col in zip(*per)]
    row["stamped_iter_us"] = [round(x, 1) for x in iters]
    row["stamped_iter_eighths_us"] = [round(statistics.median(iters[i * 16:(i + 1) * 16 - (i == 7)]), 1)
                                      for i in range(8)]
    row["streamed_ms_128"] = timed(streamed, 5)
    rows.append(row)
    print(json.dumps({k: v for k, v in row.items() if k != "stamped_iter_us"}), flush=True)
    release_graphs(model)
    del model, calls
    torch.cuda.empty_cache()
pathlib.Path(os.environ.get("OUT", "."), f"ab_{tree}.json").write_text(json.dumps(rows, indent=1))
