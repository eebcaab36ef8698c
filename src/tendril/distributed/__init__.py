"""Tensor-parallel decoding: one Llama-family model split over the GPUs of one host, one process per GPU.

Each rank of a `torchrun` (or `torch.multiprocessing`) group loads the same model, shards it with
`shard_llama(model, rank, world)` and calls the ordinary `tendril.generate` with the same arguments as
every other rank; every rank returns the same tokens::

    torch.distributed.init_process_group("nccl")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.cuda.set_device(rank)
    model = shard_llama(AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).cuda(), rank, world)
    tokens = tendril.generate(model, ids.cuda(), max_new_tokens=128, step="fused")

A launcher rather than `generate(..., tp=N)`: decoding on N GPUs needs N processes (one CUDA context and
one NCCL communicator each), which `torchrun` starts and wires; inside them the single-GPU API is unchanged.
`sharding.py` says what each rank holds, `llama.py` how a shard decodes.
"""

from tendril.distributed.llama import TensorParallelLlama
from tendril.distributed.sharding import (
    ColumnParallelLinear,
    RowParallelLinear,
    Shard,
    VocabParallelHead,
    shard_llama,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Shard",
    "TensorParallelLlama",
    "VocabParallelHead",
    "shard_llama",
]
