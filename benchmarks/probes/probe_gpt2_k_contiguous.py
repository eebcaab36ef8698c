"""One-off: GPT-2 fp16 greedy decode with its Conv1D weights as HF lays them out ([in, out], columns contiguous)
against the same weights re-laid out K-contiguous (each weight's storage transposed, the module's tensor a transposed
view, so the model computes the same products); two copies of the model, calls interleaved in one process. Also beam4."""
import torch

from benchmarks.cases.generation import gpt2, tendril_generate
from tendril.utils.timing import time_interleaved

dev = torch.device("cuda")
torch.manual_seed(0)
a = gpt2(dev, torch.float16)
b = gpt2(dev, torch.float16)
b.load_state_dict(a.state_dict())
moved = 0
with torch.no_grad():
    for module in b.modules():
        if type(module).__name__ == "Conv1D":
            w = module.weight
            module.weight = torch.nn.Parameter(w.t().contiguous().t(), requires_grad=False)
            moved += 1
print("moved", moved, "strides", b.transformer.h[0].attn.c_attn.weight.stride(), flush=True)
prompt = torch.randint(0, 1000, (1, 16), device=dev)
for beams in (1, 4):
    run_a = tendril_generate(a, 128, beams, step="fused")
    run_b = tendril_generate(b, 128, beams, step="fused")
    out_a, out_b = run_a(prompt), run_b(prompt)
    for _ in range(3):
        run_a(prompt); run_b(prompt)
    t = time_interleaved({"hf_layout": run_a, "k_contiguous": run_b}, [(prompt,)] * 40, device=dev)
    us = {k: round(v.median_ms / 128 * 1e3, 2) for k, v in t.items()}
    print(f"beams={beams} us/token", us, "ratio", round(us["k_contiguous"] / us["hf_layout"], 4),
          "same tokens", torch.equal(out_a, out_b), flush=True)
