"""The fastest a decode step made of one kernel per operation can be: a chain of pure weight-streaming kernels.

A batch-1 decode step is a chain of dependent operations (per layer: the QKV projection, attention, the output
projection, the MLP's up and down projections; then the LM head and the token choice), each of which must read its
weights (attention: the KV cache). This tool replaces every operation by the cheapest kernel that can stand in for
it: one that streams exactly the operation's bytes (wide vector loads, all of a program's loads issued before
anything else), sums them, and hands one value to the next kernel, which reads it, so each depends on the one
before. The chain is captured in a CUDA graph and replayed; with programmatic dependent launch (PDL) each kernel
issues its loads before it waits for the previous one, as the fused decode kernels do.

What no design that launches a kernel per operation can beat is then measured, per model:
- `chain` (PDL and plain): the chain above, at the best of a few program sizes;
- `empty chain`: the same number of dependent kernels reading nothing (the dependency latency alone);
- `one read`: the same bytes streamed by one kernel (the bandwidth floor).
A target below the PDL chain's time needs fewer dependent kernels: work of several operations fused into one
persistent kernel that streams across their boundaries.

Stages come from the models' parameters (built on the meta device: no memory, no download), grouped by name per
architecture (`STAGE_GROUPS`); every parameter but the input embedding table lands in exactly one stage.

    PYTHONPATH=src:. python3 -m benchmarks.tools.decode_chain_floor --out OUT [--models gpt2,llama1b] [--quick]

Writes OUT/decode_chain_floor.json and .md. Needs a CUDA GPU (PDL: compute capability 9.0 or later).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from torch import nn

from benchmarks.cases.decode_models import LLAMA_1B

PROMPT_LEN = 16
NEW_TOKENS = 128
"""The KV cache is read at the mean length of `decode-roofline`'s run: the prompt plus half the new tokens."""
CONFIGS = ((4, 4), (4, 8), (8, 4), (8, 8), (4, 16))
"""(warps, 16-byte vectors per thread) a program streams; a program reads warps × 32 × vectors × 16 bytes."""
REPLAYS = 20
SAMPLES = 15


@dataclass(frozen=True)
class Stage:
    name: str
    nbytes: int


STAGE_GROUPS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "gpt2": (("qkv", ("ln_1.", "attn.c_attn.")), ("attention", ()), ("o_proj", ("attn.c_proj.",)),
             ("up", ("ln_2.", "mlp.c_fc.")), ("down", ("mlp.c_proj.",))),
    "llama": (("qkv", ("input_layernorm.", "q_proj.", "k_proj.", "v_proj.")), ("attention", ()),
              ("o_proj", ("o_proj.",)), ("up", ("post_attention_layernorm.", "gate_proj.", "up_proj.")),
              ("down", ("down_proj.",))),
}
"""Per architecture, a layer's operations in order: the parameter-name parts whose parameters each reads (none:
attention, which reads the KV cache)."""


def build(model: str) -> nn.Module:
    """GPT-2 124M (fp16) or Llama-3.2-1B's shape (bf16), as `decode-roofline` builds them, on the meta device."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        if model == "gpt2":
            return GPT2LMHeadModel(GPT2Config()).half()
        if model == "llama1b":
            return LlamaForCausalLM(LlamaConfig(**LLAMA_1B)).to(torch.bfloat16)
    raise ValueError(f"unknown model {model!r}: expected gpt2 or llama1b")


def decode_stages(model: nn.Module, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS) -> list[Stage]:
    """The step's operations in order with the bytes each must read (module docstring): as `decode-roofline`
    counts them, every parameter once but the embedding tables other than the LM head, and the KV cache."""
    config = model.config  # type: ignore[attr-defined]
    groups = STAGE_GROUPS["gpt2" if config.model_type == "gpt2" else "llama"]
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    head = model.get_output_embeddings().weight  # type: ignore[operator]
    kv_bytes = int(2 * kv_heads * head_dim * (prompt_len + (new_tokens - 1) / 2) * head.element_size())
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) and m.weight is not head}
    params = {name: p for name, p in model.named_parameters() if id(p) not in tables}
    unclaimed = dict(params)
    stages = []
    for layer in range(config.num_hidden_layers):
        for name, parts in groups:
            mine = [n for n in params if f".{layer}." in n and any(part in n for part in parts)] if parts else []
            for n in mine:
                del unclaimed[n]
            stages.append(Stage(name, sum(params[n].numel() * params[n].element_size() for n in mine) if parts
                                else kv_bytes))
    stray = [n for n, p in unclaimed.items() if p is not head and "norm" not in n and "ln_f" not in n]
    if stray:
        raise ValueError(f"parameters in no stage: {stray}")
    stages.append(Stage("norm+head", sum(p.numel() * p.element_size() for p in unclaimed.values())))
    stages.append(Stage("token choice", head.shape[0] * 4))
    return stages


@triton.jit
def _stream_kernel(src_ptr, prev_ptr, out_ptr, n_vectors, VECTORS: tl.constexpr, LANES: tl.constexpr,
                   PDL: tl.constexpr):
    """Program `p` sums its `LANES × VECTORS` 16-byte vectors of `src` (`LANES`: its threads; int32 quads, all loads
    issued first), then, after the previous kernel (PDL: waiting for it only now), adds the value it left and
    stores the sum where the next kernel reads it."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    base = tl.program_id(0).to(tl.int64) * LANES * VECTORS
    total = tl.zeros([LANES, 4], dtype=tl.int32)
    quad = tl.arange(0, 4)[None, :]
    for v in tl.static_range(VECTORS):
        vector = base + v * LANES + tl.arange(0, LANES)[:, None]
        total += tl.load(src_ptr + vector * 4 + quad, mask=vector < n_vectors, other=0)
    if PDL:
        tl.extra.cuda.gdc_wait()
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(total, axis=1), axis=0) + tl.load(prev_ptr))


class Chain:
    """Kernels streaming each stage's bytes from its own buffer, each reading the value the one before left."""

    def __init__(self, sizes: Sequence[int], warps: int, vectors: int, pdl: bool, device: torch.device) -> None:
        per_program = warps * 32 * vectors
        self.launches = []
        prev = torch.zeros(1, dtype=torch.int32, device=device)
        for nbytes in sizes:
            n_vectors = -(-nbytes // 16)
            src = torch.ones(n_vectors * 4, dtype=torch.int32, device=device)
            grid = max(1, -(-n_vectors // per_program))
            out = torch.zeros(grid, dtype=torch.int32, device=device)
            self.launches.append((grid, src, prev, out, n_vectors))
            prev = out
        self.warps, self.vectors, self.pdl = warps, vectors, pdl

    def __call__(self) -> None:
        for grid, src, prev, out, n_vectors in self.launches:
            _stream_kernel[(grid,)](src, prev, out, n_vectors, VECTORS=self.vectors, LANES=self.warps * 32,
                                    PDL=self.pdl, num_warps=self.warps, launch_pdl=self.pdl)


def graph_us(run: Callable[[], None], replays: int, samples: int) -> float:
    """Median µs per replay of `run` captured in a CUDA graph (`replays` replays per timed sample)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / replays)
    return statistics.median(times)


def best_chain(sizes: Sequence[int], pdl: bool, device: torch.device, configs: Sequence[tuple[int, int]],
               replays: int, samples: int) -> dict[str, Any]:
    """The chain at each configuration; the fastest."""
    timed = []
    for warps, vectors in configs:
        chain = Chain(sizes, warps, vectors, pdl, device)
        timed.append({"warps": warps, "vectors": vectors, "us": round(graph_us(chain, replays, samples), 2)})
        del chain
        torch.cuda.empty_cache()
    return {"best": min(timed, key=lambda t: t["us"]), "configs": timed}


def measure(model_name: str, device: torch.device, quick: bool) -> dict[str, Any]:
    """One model's stages, its one read, its empty chain and its chain, with PDL (key "True") and without."""
    stages = decode_stages(build(model_name))
    sizes = [s.nbytes for s in stages]
    configs = CONFIGS[:2] if quick else CONFIGS
    replays, samples = (3, 3) if quick else (REPLAYS, SAMPLES)

    def chain(chain_sizes: list[int], pdl: bool, tried: Sequence[tuple[int, int]] = configs) -> dict[str, Any]:
        return best_chain(chain_sizes, pdl, device, tried, replays, samples)

    one_read = chain([sum(sizes)], False)["best"]["us"]
    return {
        "model": model_name, "stages": len(stages), "bytes": sum(sizes),
        "stage_bytes": {name: sorted({s.nbytes for s in stages if s.name == name})
                        for name in dict.fromkeys(s.name for s in stages)},
        "one_read_us": one_read,
        "read_gb_per_s": round(sum(sizes) / one_read / 1e3, 1),
        "empty_chain_us": {str(pdl): chain([0] * len(stages), pdl, configs[:1])["best"]["us"] for pdl in (True, False)},
        "chain": {str(pdl): chain(sizes, pdl) for pdl in (True, False)},
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# The decode step's floor for one kernel per operation (`benchmarks.tools.decode_chain_floor`)",
        "",
        f"- command: `{report['command']}`; {report['date']}",
        f"- device: {report['device']}; torch {report['torch']}; triton {report['triton']}",
        f"- KV cache read at {PROMPT_LEN} + {NEW_TOKENS - 1}/2 positions; each stage a kernel streaming its bytes "
        "(module docstring); best of the program sizes (warps, 16-byte vectors per thread) per row",
        "",
        "| model | stages | MB | one read µs | GB/s | empty chain µs, PDL / plain | chain µs, PDL | chain µs, plain "
        "| one read / chain (PDL) |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    for m in report["models"]:
        pdl, plain = m["chain"]["True"]["best"], m["chain"]["False"]["best"]
        lines.append(
            f"| {m['model']} | {m['stages']} | {m['bytes'] / 1e6:.1f} | {m['one_read_us']:.2f} "
            f"| {m['read_gb_per_s']:.0f} | {m['empty_chain_us']['True']:.2f} / {m['empty_chain_us']['False']:.2f} "
            f"| {pdl['us']:.2f} ({pdl['warps']}w×{pdl['vectors']}) "
            f"| {plain['us']:.2f} ({plain['warps']}w×{plain['vectors']}) | {m['one_read_us'] / pdl['us']:.3f} |")
    lines += ["", "## Stage bytes (per layer, then the head and token choice)", ""]
    for m in report["models"]:
        parts = ", ".join(f"{name} {'/'.join(f'{b / 1e6:.2f}' for b in sizes)} MB"
                          for name, sizes in m["stage_bytes"].items())
        lines.append(f"- {m['model']}: {parts}")
    lines += ["", "## Every configuration, µs per step", "", "| model | PDL | " +
              " | ".join(f"{w}w×{v}" for w, v in CONFIGS) + " |", "|---|---|" + "---:|" * len(CONFIGS)]
    for m in report["models"]:
        for pdl in ("True", "False"):
            by = {(c["warps"], c["vectors"]): c["us"] for c in m["chain"][pdl]["configs"]}
            lines.append(f"| {m['model']} | {'yes' if pdl == 'True' else 'no'} | " +
                         " | ".join(f"{by[c]:.2f}" if c in by else "-" for c in CONFIGS) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="gpt2,llama1b")
    parser.add_argument("--quick", action="store_true", help="two program sizes, few replays")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode_chain_floor needs a CUDA GPU")
    device = torch.device("cuda")
    report = {
        "command": " ".join(["python3 -m benchmarks.tools.decode_chain_floor",
                             *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
        "models": [measure(name.strip(), device, args.quick) for name in args.models.split(",")],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_chain_floor.json").write_text(json.dumps(report, indent=1))
    (args.out / "decode_chain_floor.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
