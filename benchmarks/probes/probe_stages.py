"""One-off: sweep the pipelined one-row launches of Llama-1B's projections, then time the greedy decode with the
best launch per shape against the defaults, in one process."""
import itertools
import json
import sys
import time

import torch

from benchmarks.tools import profile_generation as p
from tendril.generation import generate
from tendril.generation.api import release_graphs
from tendril.generation.kernels import launch, linear
from tendril.utils.timing import time_callable


def configs(out_f, in_f, k_contiguous, rows=1, size=0, normed=False, segments=1):
    d = launch.launch_config(segments * out_f, in_f, rows, k_contiguous=k_contiguous, sm_count=132, normed=normed)
    out = [(d.block_n, d.block_k, d.split_k, d.num_warps, d.dot, 0)]
    splits = (2, 4) if in_f >= 4096 else ((1, 2) if segments * out_f <= 4096 else (1,))
    for bn, bk, sk, w, st in itertools.product((16, 32, 64), (128, 256), splits, (4, 8), (3, 4)):
        out.append((bn, bk, sk, w, False, st))
    return out


def main():
    out = sys.argv[1]
    p.sweep_configs = configs
    begin = time.time()
    sweep = p.sweep_linear("llama1b", 1, 0)
    print(f"sweep took {time.time() - begin:.0f} s", flush=True)
    best = {}
    for shape, entry in zip(p.SWEEP_SHAPES["llama1b"], sweep):
        label, out_f, in_f, _, _, _, _, *gated = shape
        columns = out_f * (2 if gated and gated[0] else 1)
        b = entry["best"]
        best[(columns, in_f)] = launch.LaunchConfig(1, b["block_n"], b["block_k"], b["split_k"], b["warps"], False,
                                                    b["stages"])
        default = entry["configs"][0]["us"]
        print(label, f"default {default:.2f} best {b['us']:.2f}", {k: b[k] for k in
              ("block_n", "block_k", "split_k", "warps", "stages")}, f"cublas {entry['cublas_us']:.2f}", flush=True)
    original = linear.launch_config

    def patched(columns, in_features, rows, **kw):
        if rows == 1 and (columns, in_features) in best:
            return best[(columns, in_features)]
        return original(columns, in_features, rows, **kw)

    device = torch.device("cuda")
    model = p.MODELS["llama1b"][1](device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (1, 16), generator=gen).to(device) for _ in range(4)]
    results = {}
    for name in ("default", "best", "default", "best"):
        linear.launch_config = patched if name == "best" else original
        release_graphs(model)

        def call(prompt):
            return generate(model, prompt, max_new_tokens=128, eos_token_id=[], pad_token_id=0, step="fused")

        first = call(prompts[0]).clone()
        timing = time_callable(call, [(q,) for q in prompts], device="cuda", warmup=1, reps=10)
        results.setdefault(name, []).append(timing.median_ms / 128 * 1e3)
        results.setdefault(name + "_tokens", first[0, -8:].tolist())
        print(name, f"{timing.median_ms / 128 * 1e3:.1f} us/token", flush=True)
    json.dump({"sweep": sweep, "decode": results}, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
