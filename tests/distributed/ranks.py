"""What each rank of the tensor-parallel tests runs (a module of its own, so spawned processes import it)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tendril
from tendril.distributed import shard_llama
from tendril.generation import loop
from tests.generation.models import left_padded, tiny_model

RUNS = {
    "llama fused": ("llama", dict(step="fused")),
    "llama eager": ("llama", dict(step="eager")),
    "llama compiled": ("llama", dict(step="compiled")),
    "qwen2 fused": ("qwen2", dict(step="fused")),
    "llama fused sampled": ("llama", dict(step="fused", do_sample=True, top_k=20, seed=7)),
    "llama fused beams": ("llama", dict(step="fused", num_beams=2)),
}
"""name -> (tiny model family, `generate` options) of each decode every rank runs."""

MAX_NEW_TOKENS = 8


def prompt() -> tuple[torch.Tensor, torch.Tensor]:
    return left_padded([5, 3], seed=1)


def decode(model: torch.nn.Module, options: dict, device: str = "cpu") -> torch.Tensor:
    ids, mask = prompt()
    return tendril.generate(model, ids.to(device), mask.to(device), max_new_tokens=MAX_NEW_TOKENS, eos_token_id=[],
                            pad_token_id=0, **options).cpu()


def _rank(rank: int, world: int, port: int, backend: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # Dynamo traces the collectives; no code generation on the CPU (as in tests/generation/test_compile.py)
        loop.COMPILE_BACKEND = "eager"
    try:
        results = {}
        for name, (family, options) in RUNS.items():
            model = shard_llama(tiny_model(family, device=device), rank, world)
            results[name] = decode(model, options, device)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, backend: str, out: Path) -> list[dict[str, torch.Tensor]]:
    """Every rank's tokens of each of `RUNS`, decoded by `world` spawned ranks on 127.0.0.1 (the rendezvous
    store is served from here, on a port the system chose, so no other process can take it meanwhile)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    mp.spawn(_rank, args=(world, store.port, backend, str(out)), nprocs=world, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(world)]
