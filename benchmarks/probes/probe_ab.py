"""One-off: the one-row deep-tile rule on and off, in one process, interleaved (two copies of the model)."""
import sys, torch
from benchmarks.cases.generation import gpt2, tendril_generate
from benchmarks.cases.decode_models import llama
from tendril.generation.kernels import launch
from tendril.utils.timing import time_interleaved
name = sys.argv[1]
dev = torch.device("cuda")
build = (lambda: gpt2(dev, torch.float16)) if name == "gpt2" else (lambda: llama(dev, torch.bfloat16))
a, b = build(), build()
prompt = torch.randint(0, 1000, (1, 16), device=dev)
run_a = tendril_generate(a, 128, 1, step="fused")
out_a = run_a(prompt)
original = launch._one_row_deep
launch._one_row_deep = lambda *args: None
launch.launch_config.cache_clear()
run_b = tendril_generate(b, 128, 1, step="fused")
out_b = run_b(prompt)
launch._one_row_deep = original
launch.launch_config.cache_clear()
for _ in range(3):
    run_a(prompt); run_b(prompt)
t = time_interleaved({"deep": run_a, "shallow": run_b}, [(prompt,)] * 30, device=dev)
us = {k: round(v.median_ms / 128 * 1e3, 1) for k, v in t.items()}
print(name, "us/token", us, "ratio", round(us["deep"] / us["shallow"], 4), "same tokens", torch.equal(out_a, out_b), flush=True)
