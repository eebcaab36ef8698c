"""Case `tp-decode` (needs 2 GPUs on one host): tensor-parallel graphed decode of the Llama-3.1-8B shape.

Random bf16 weights of Llama-3.1-8B's shape (32 layers, hidden 4096, 32 query / 8 kv heads, MLP 14336,
vocabulary 128256; RoPE at the config's default, which costs the same), batch 1, a 16-token prompt, 128 new
tokens, greedy, `step="fused"`, eos disabled. Two processes, one per GPU, joined by NCCL:
- `tp1`: rank 0 alone decodes with the whole model (`tendril.generate`, one graph launch per call) while
  rank 1 waits;
- `tp2`: both ranks shard the model (`tendril.distributed.shard_llama`) and decode together, the
  collectives captured inside each rank's loop graph.
Each is timed per call (prompt pass + 128 tokens) and per call of one new token (the prompt pass and the
first choice); a decode step is their difference over the other 127 tokens.

`llama8b_tp1_roofline_fraction`: the time one step would take reading every weight once at the HBM bandwidth
measured here (a device-to-device copy of `COPY_BYTES`), over the measured tp1 step.
`llama8b_tp2_speedup_vs_tp1`: ms per call of tp1 over tp2. Also reported: the collectives of one tp2 step
(an all-reduce of the hidden state after each row-parallel projection, 64 of them, and the all-gather of the
logits) captured as one graph and replayed on their own, ms per replay; and whether tp1 and tp2 choose the
same tokens (in bf16 the shards sum in another order, so near ties may go the other way).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

import tendril
from benchmarks.registry import Context, Goal, register
from tendril.distributed import Shard, shard_llama
from tendril.generation.api import graphed_runners, release_graphs
from tendril.graphs.control import control_flow_stats
from tendril.utils.timing import time_callable

WORLD = 2
PROMPT_LEN = 16
NEW_TOKENS = 128
COPY_BYTES = 4 << 30
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5,
                hidden_act="silu", tie_word_embeddings=False)


def llama_8b(device: torch.device) -> torch.nn.Module:
    """Llama-3.1-8B's shape with random bf16 weights (the same on every rank: same seed, same kind of GPU)."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_8B))
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every matrix and norm once, one row of the embeddings."""
    embeddings = model.get_input_embeddings().weight
    read = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embeddings)
    return read + embeddings.shape[1] * embeddings.element_size()


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Bytes per second of a device-to-device copy of `COPY_BYTES` (each byte read once, written once)."""
    source = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    timing = time_callable(target.copy_, [(source,)], device=device, warmup=2, reps=reps)
    del source, target
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / (timing.median_ms / 1e3)


def decode_times(model: torch.nn.Module, ids: torch.Tensor, reps: int) -> dict[str, Any]:
    """ms per call of 128 new tokens and of 1, the step they imply, and the tokens."""

    def run(new_tokens: int) -> torch.Tensor:
        return tendril.generate(model, ids, max_new_tokens=new_tokens, step="fused", eos_token_id=[], pad_token_id=0)

    full = time_callable(run, [(NEW_TOKENS,)], device=ids.device, warmup=2, reps=reps)
    first = time_callable(run, [(1,)], device=ids.device, warmup=2, reps=reps)
    step_ms = (full.median_ms - first.median_ms) / (NEW_TOKENS - 1)
    lowering = control_flow_stats()
    graphs = "; ".join(f"{len(r.stats.graphs)} graphs, {r.stats.replays} replays, fallbacks "
                       f"{dict(r.stats.fallback_details)}" for r in graphed_runners(model))
    how = (f"loops so far: {lowering.conditional_node} conditional-node, {lowering.predication} predicated, "
           f"{lowering.eager} eager {dict(lowering.fallback_reasons)}; {graphs}")
    return dict(call=full, first=first, step_ms=step_ms, tokens=run(NEW_TOKENS).cpu(), how=how)


def collectives_ms(shard: Shard, model: torch.nn.Module, device: torch.device, reps: int) -> float:
    """ms per replay of one tp2 step's collectives, captured as one graph (what the decode graph holds)."""
    hidden = torch.zeros(1, model.config.hidden_size, dtype=torch.bfloat16, device=device)
    logits = torch.zeros(1, model.config.vocab_size // shard.world, dtype=torch.float32, device=device)

    def step() -> None:
        for _ in range(2 * model.config.num_hidden_layers):
            shard.reduce(hidden)
        shard.gather(logits)

    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        step()  # creates the communicators' state outside capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return time_callable(graph.replay, device=device, warmup=5, reps=10 * reps).median_ms


def _rank(rank: int, port: int, reps: int, out: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=WORLD, device_id=device)
    try:
        model = llama_8b(device)
        ids = torch.randint(0, LLAMA_8B["vocab_size"], (1, PROMPT_LEN), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        result: dict[str, Any] = {}
        if rank == 0:
            result["bandwidth"] = copy_bandwidth(device, reps)
            result["tp1_bytes"] = weight_bytes_per_token(model)
            result["tp1"] = decode_times(model, ids, reps)
            release_graphs(model)
            torch.cuda.empty_cache()
        dist.barrier()
        shard_llama(model, rank, WORLD)
        torch.cuda.empty_cache()
        result["tp2_bytes"] = weight_bytes_per_token(model)
        result["tp2"] = decode_times(model, ids, reps)
        release_graphs(model)
        gathered = [torch.empty_like(result["tp2"]["tokens"], device=device) for _ in range(WORLD)]
        dist.all_gather(gathered, result["tp2"]["tokens"].to(device))
        result["ranks_agree"] = all(torch.equal(g.cpu(), result["tp2"]["tokens"]) for g in gathered)
        result["collectives_ms"] = collectives_ms(Shard(rank, WORLD), model, device, reps)
        if rank == 0:
            torch.save(result, Path(out) / "rank0.pt")
    finally:
        dist.destroy_process_group()


@register("tp-decode", "needs 2 GPUs: Llama-3.1-8B shape (random bf16), 16-token prompt, 128 new tokens, greedy: "
          "tensor-parallel decode over 2 GPUs (NCCL in the loop graph) vs 1")
def run(ctx: Context) -> None:
    found = torch.cuda.device_count()
    if found < WORLD:
        raise SystemExit(f"benchmark case 'tp-decode' needs {WORLD} GPUs on one host, found {found}: nothing measured")
    reps = 3 if ctx.quick else 10
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast: it can take a shared host's GPUs down
    with tempfile.TemporaryDirectory() as out:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the ranks' rendezvous
        mp.spawn(_rank, args=(store.port, reps, out), nprocs=WORLD, join=True)
        result = torch.load(Path(out) / "rank0.pt", weights_only=False)
    tp1, tp2 = result["tp1"], result["tp2"]
    for name, times in (("tp1", tp1), ("tp2", tp2)):
        ctx.add_timing(name, times["call"])
        ctx.add_timing(name, times["first"], metric="ms_first_token")
        ctx.add_value(name, "ms_per_step", times["step_ms"])
        ctx.add_value(name, "weight_gib_per_token_per_rank", result[f"{name}_bytes"] / 2**30)
        ctx.note(f"{name}: {times['how']}")
    ctx.add_value("tp2", "collectives_ms_per_step", result["collectives_ms"])
    ctx.add_value("hbm copy", "gb_per_s", result["bandwidth"] / 1e9)
    ideal_step_ms = result["tp1_bytes"] / result["bandwidth"] * 1e3
    same = int((tp1["tokens"] == tp2["tokens"]).sum()) - PROMPT_LEN
    ctx.note(f"tp2 ranks chose the same tokens: {result['ranks_agree']}; tp1 and tp2 agree on {same} of "
             f"{NEW_TOKENS} new tokens (bf16: the shards sum in another order)")
    ctx.extra["collectives"] = {"all_reduces_per_step": 2 * LLAMA_8B["num_hidden_layers"],
                                "all_gathers_per_step": 1, "ms_per_step": result["collectives_ms"]}
    ctx.target("llama8b_tp2_speedup_vs_tp1", tp1["call"].median_ms / tp2["call"].median_ms, Goal(">=", 1.6))
    ctx.target("llama8b_tp1_roofline_fraction", ideal_step_ms / tp1["step_ms"], Goal(">=", 0.7))
