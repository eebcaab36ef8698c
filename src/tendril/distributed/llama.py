"""The decode path of a tensor-parallel Llama shard (see `sharding.py` for what each rank holds).

Prompt pass: the architecture's own forward over the sharded modules, whose row-parallel projections and
vocab-parallel head reduce and gather by themselves; with `step="fused"` a short prompt
(`loop.FUSED_PROMPT_TOKENS`) runs the fused kernels instead, as one-token steps do. One-token steps (`step="fused"`):
the fused kernels of `Llama.fused_step` over this rank's heads and features, with the `Shard` as its `parallel` (an
all-reduce after each row-parallel projection and an all-gather of the logits). Rank 0 adds the residual inside its
o_proj / down kernel and the other ranks add nothing, so the all-reduce of the partial outputs is the next hidden
state: no kernel is added for the residual. The KV cache of a rank holds its kv heads only.

On CUDA the collectives are NCCL's, enqueued on the current stream's capture like any kernel, so they land
inside the loop graph (the WHILE node's body included); the first, uncaptured call creates the
communicators. `step="compiled"` compiles the architecture's forward with the collectives of the sharded
modules in it (Dynamo traces them as functional collectives).
"""

from __future__ import annotations

from torch import nn

from tendril.distributed.sharding import Shard
from tendril.generation.architectures.base import CacheLayout
from tendril.generation.architectures.llama import Llama


class TensorParallelLlama(Llama):
    """`Llama`'s decode path over rank `shard.rank`'s part of the model."""

    def __init__(self, model: nn.Module, shard: Shard) -> None:
        self.shard = shard
        self.parallel = shard  # the fused step reduces after row-parallel projections and gathers the logits
        super().__init__(model)

    def layout(self) -> CacheLayout:
        whole = super().layout()
        return CacheLayout(whole.num_layers, whole.kv_heads // self.shard.world, whole.head_dim)
