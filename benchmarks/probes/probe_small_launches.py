"""One-off: GPT-2 fp16 fused decode with the small-launch rule (`launch.SMALL_LAUNCH_BYTES_PER_SM`) on and off, in
one process, interleaved (two copies of the model, the rule off while the second builds and captures its loop)."""
import torch

from benchmarks.cases.generation import gpt2, tendril_generate
from tendril.generation.kernels import launch
from tendril.utils.timing import time_interleaved

dev = torch.device("cuda")
torch.manual_seed(0)
a = gpt2(dev, torch.float16)
b = gpt2(dev, torch.float16)
b.load_state_dict(a.state_dict())
prompt = torch.randint(0, 1000, (1, 16), device=dev)
run_a = tendril_generate(a, 128, 1, step="fused")
out_a = run_a(prompt)
rule = launch.SMALL_LAUNCH_BYTES_PER_SM
launch.SMALL_LAUNCH_BYTES_PER_SM = 0
launch.launch_config.cache_clear()
run_b = tendril_generate(b, 128, 1, step="fused")
out_b = run_b(prompt)
launch.SMALL_LAUNCH_BYTES_PER_SM = rule
launch.launch_config.cache_clear()
for _ in range(3):
    run_a(prompt); run_b(prompt)
for trial in range(2):
    t = time_interleaved({"small_rule": run_a, "widest": run_b}, [(prompt,)] * 40, device=dev)
    us = {k: round(v.median_ms / 128 * 1e3, 2) for k, v in t.items()}
    print(f"trial {trial} us/token", us, "ratio", round(us["small_rule"] / us["widest"], 4), "same tokens",
          torch.equal(out_a, out_b), flush=True)
