"""The decode path of a tensor-parallel Llama shard (see `sharding.py` for what each rank holds).

Prompt pass: the architecture's own forward over the sharded modules, whose row-parallel projections and
vocab-parallel head reduce and gather by themselves. One-token steps (`step="fused"`): the fused kernels of
`Llama.fused_step` over this rank's heads and features, with an all-reduce after each row-parallel
projection and an all-gather of the logits. Rank 0 adds the residual inside its o_proj / down kernel and the
other ranks add nothing, so the all-reduce of the partial outputs is the next hidden state: no kernel is
added for the residual. The KV cache of a rank holds its kv heads only.

On CUDA the collectives are NCCL's, enqueued on the current stream's capture like any kernel, so they land
inside the loop graph (the WHILE node's body included); the first, uncaptured call creates the
communicators. `step="compiled"` compiles the architecture's forward with the collectives of the sharded
modules in it (Dynamo traces them as functional collectives).
"""

from __future__ import annotations

import torch
from torch import nn

from tendril.distributed.sharding import Shard
from tendril.generation.architectures.base import CacheLayout, StepForward, one_token
from tendril.generation.architectures.llama import Llama
from tendril.generation.cache import StaticKVCache
from tendril.generation.kernels import decode_attention, fused_linear


class TensorParallelLlama(Llama):
    """`Llama`'s decode path over rank `shard.rank`'s part of the model."""

    def __init__(self, model: nn.Module, shard: Shard) -> None:
        self.shard = shard
        super().__init__(model)

    def layout(self) -> CacheLayout:
        whole = super().layout()
        return CacheLayout(whole.num_layers, whole.kv_heads // self.shard.world, whole.head_dim)

    def fused_step(self) -> StepForward:
        activation, layers, final_norm, head = self.fused_weights()
        base = self.model.model
        shard = self.shard

        def forward(
            tokens: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor, cache: StaticKVCache
        ) -> torch.Tensor:
            one_token(tokens)
            hidden = base.embed_tokens(tokens)
            cos, sin = base.rotary_emb(hidden, positions)
            rotary = ("half", cos[:, 0], sin[:, 0])
            hidden = hidden[:, 0]
            for index, (norm_1, qkv, attn_out, norm_2, gate_up, down, scale) in enumerate(layers):
                query, key, value = fused_linear(hidden, qkv, norm=norm_1).split(qkv.out_sizes, dim=1)
                out = decode_attention(query, key, value, cache.keys[index], cache.values[index], cache.key_valid,
                                       query_slots, scale, rotary)
                hidden = shard.reduce(fused_linear(out, attn_out, addends=shard.residual(hidden)))
                gated = fused_linear(hidden, gate_up, norm=norm_2, activation=activation, gated=True)
                hidden = shard.reduce(fused_linear(gated, down, addends=shard.residual(hidden)))
            return shard.gather(fused_linear(hidden, head, norm=final_norm, out_dtype=torch.float32))

        return forward
