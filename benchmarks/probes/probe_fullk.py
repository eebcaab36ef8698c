"""One-off: Llama-1B's one-row projections with full-K tiles, against the defaults and the streaming floor."""
import sys, json, torch
from benchmarks.tools import profile_generation as pg
from benchmarks.tools import decode_chain_floor as floor
from tendril.generation.kernels import launch

model = sys.argv[1] if len(sys.argv) > 1 else "llama1b"
only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
def configs(out_f, in_f, k_contiguous, rows=1, size=0, normed=False, segments=1):
    d = launch.launch_config(segments * out_f, in_f, rows, k_contiguous=k_contiguous, sm_count=132, normed=normed)
    chosen = [(d.block_n, d.block_k, d.split_k, d.num_warps, d.dot)]
    import triton
    top = triton.next_power_of_2(in_f)
    for bk in (top, top // 2, top // 4):
        for bn in (1, 2, 4, 8, 16, 32):
            for warps in (4, 8):
                elems = bn * bk * segments
                if 4096 <= elems <= 32768 and bk >= 256 and (bn, bk, 1, warps, False) not in chosen:
                    chosen.append((bn, bk, 1, warps, False))
    return chosen
pg.sweep_configs = configs
dtype = torch.float16 if model == "gpt2" else torch.bfloat16
results = []
for shape in pg.SWEEP_SHAPES[model]:
    if only and shape[0] not in only:
        continue
    entry = pg._sweep_shape(*shape, rows=1, dtype=dtype, size=0)
    gated = len(shape) > 7 and shape[7]
    nbytes = (2 if gated else 1) * shape[1] * shape[2] * 2
    launches = 24
    best = None
    for warps, vectors in floor.CONFIGS:
        chain = floor.Chain([nbytes] * launches, warps, vectors, True, torch.device("cuda"))
        us = floor.graph_us(chain, 10, 7) / launches
        best = us if best is None else min(best, us)
        del chain; torch.cuda.empty_cache()
    entry["floor_us"] = best
    results.append(entry)
    print(f"== {entry['shape']} MB {nbytes/1e6:.1f} cublas {entry['cublas_us']:.2f} floor {best:.2f}", flush=True)
    for c in sorted(entry["configs"], key=lambda c: c.get("us", 1e9)):
        print(f"   {'*' if c['default'] else ' '} n={c['block_n']:3d} k={c['block_k']:5d} split={c['split_k']} w={c['warps']} "
              f"us={c.get('us', float('nan')):8.2f} diff={c.get('max_abs_diff_vs_default', c.get('error', ''))}", flush=True)
import os
out = os.environ.get("OUT", "/tmp")
json.dump(results, open(f"{out}/probe_fullk_{model}.json", "w"), indent=1)
