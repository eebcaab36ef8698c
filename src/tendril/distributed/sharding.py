"""Megatron-style sharding of a Llama-family model over the ranks of a process group.

Per decoder layer, q/k/v and gate/up are column-parallel (each rank keeps whole heads, the kv heads of
grouped-query attention split the same way, and a slice of the MLP's intermediate features); o_proj and
down are row-parallel (each rank keeps the input features matching its heads or its intermediate slice,
and the partial outputs are summed by an all-reduce). The LM head is vocab-parallel: each rank computes the
logits of its slice of the vocabulary, and an all-gather puts the whole row on every rank, so every logits
processor, the sampler and the argmax run unchanged and choose the same token on every rank (all inputs of
that choice are the same bits everywhere). Embeddings and norms are replicated: an embedding lookup reads
one row, a norm's weight is one vector, so splitting either would save no memory traffic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tendril.generation.api import release_graphs
from tendril.generation.architectures.base import DECODER_ATTRIBUTE, decoder_for
from tendril.generation.architectures.llama import Llama

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""The all-gather into one tensor (`all_gather_into_tensor` is its name in the older torch releases tendril
supports, deprecated in the newer ones)."""


@dataclass(frozen=True)
class Shard:
    """Which part of the model a rank holds, and the collectives that join the parts.

    With `world == 1` the collectives are no-ops, so a one-rank shard runs exactly the kernels of the model
    it came from, without a process group.
    """

    rank: int
    world: int
    group: dist.ProcessGroup | None = None
    """The process group of the ranks (None: the default group)."""

    def __post_init__(self) -> None:
        if self.world < 1 or not 0 <= self.rank < self.world:
            raise ValueError(f"rank must lie in [0, world) with world >= 1, got rank {self.rank}, world {self.world}")

    def span(self, size: int) -> slice:
        """This rank's contiguous share of `size` items (`size` divisible by `world`)."""
        share = size // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    def residual(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The addends of a row-parallel projection on this rank: the residual on rank 0 only, so the
        all-reduce of the partial outputs adds it once."""
        return (hidden,) if self.rank == 0 else ()

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `partial`, in place."""
        if self.world > 1:
            dist.all_reduce(partial, group=self.group)
        return partial

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """[rows, n] on each rank -> [rows, world * n], rank r's columns at [r * n, (r + 1) * n)."""
        if self.world == 1:
            return local
        rows, width = local.shape
        gathered = local.new_empty(self.world * rows, width)
        _all_gather_single(gathered, local.contiguous(), group=self.group)
        return gathered.view(self.world, rows, width).permute(1, 0, 2).reshape(rows, self.world * width)


def _parameter(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor.detach().clone(), requires_grad=False)


class _ShardLinear(nn.Linear):
    """An `nn.Linear` holding given weight and bias tensors (so the fused kernels read it like any other)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, shard: Shard) -> None:
        out_features, in_features = weight.shape
        super().__init__(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
        self.weight = _parameter(weight)
        if bias is not None:
            self.bias = _parameter(bias)
        self.shard = shard


class ColumnParallelLinear(_ShardLinear):
    """This rank's output features of a linear layer: its rows of the weight and of the bias."""

    @classmethod
    def of(cls, linear: nn.Linear, shard: Shard) -> ColumnParallelLinear:
        rows = shard.span(linear.out_features)
        return cls(linear.weight[rows], None if linear.bias is None else linear.bias[rows], shard)


class RowParallelLinear(_ShardLinear):
    """This rank's input features of a linear layer; the output is the all-reduced sum over the ranks. The
    bias stays on rank 0, so it is added once."""

    @classmethod
    def of(cls, linear: nn.Linear, shard: Shard) -> RowParallelLinear:
        bias = linear.bias if shard.rank == 0 else None
        return cls(linear.weight[:, shard.span(linear.in_features)], bias, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shard.reduce(super().forward(x))


class VocabParallelHead(_ShardLinear):
    """This rank's slice of the vocabulary of the LM head; the output is every rank's logits, gathered."""

    @classmethod
    def of(cls, linear: nn.Linear, shard: Shard) -> VocabParallelHead:
        rows = shard.span(linear.out_features)
        return cls(linear.weight[rows], None if linear.bias is None else linear.bias[rows], shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)
        return self.shard.gather(local.reshape(-1, local.shape[-1])).reshape(*local.shape[:-1], -1)


def check_divisible(config: object, world: int) -> None:
    """A ValueError naming each size of `config` that `world` ranks cannot split evenly."""
    sizes = {name: getattr(config, name) for name in
             ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size")}
    uneven = [f"{name} = {size}" for name, size in sizes.items() if size % world]
    if uneven:
        raise ValueError(f"tensor parallelism over {world} ranks splits whole heads, the MLP's intermediate features "
                         f"and the vocabulary evenly; not divisible by {world}: {', '.join(uneven)}")


def shard_llama(model: nn.Module, rank: int, world: int, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Turn a Llama-family HF model (Llama, Mistral, Qwen2) into rank `rank`'s shard of `world`, in place.

    Every rank shards the same model (same weights) with its own rank; afterwards `tendril.generate(model,
    ...)`, called by every rank of `group` with the same arguments, decodes with the shards (on CUDA each
    rank's all-reduces are captured in its loop graph) and returns the same tokens on every rank. The
    sharded projections and the LM head hold copies of their slices, so the full weights are freed with the
    model's other references to them; embeddings and norms are shared. Decode paths tendril built for the
    model before are released. `world == 1` leaves the computation as it was (no process group needed).
    Raises ValueError for other architectures, sizes `world` does not divide, or a model already sharded.
    """
    from tendril.distributed.llama import TensorParallelLlama

    shard = Shard(rank, world, group)
    hf: Any = model
    if DECODER_ATTRIBUTE in model.__dict__:
        raise ValueError("the model is sharded already: shard a freshly loaded model")
    if type(decoder_for(model)) is not Llama:
        raise ValueError(f"shard_llama shards the Llama family (llama, mistral, qwen2), got model_type "
                         f"{hf.config.model_type!r}")
    check_divisible(hf.config, world)
    if world > 1 and dist.is_initialized() and (dist.get_rank(group), dist.get_world_size(group)) != (rank, world):
        raise ValueError(f"rank {rank} of {world} differs from the process group's rank {dist.get_rank(group)} of "
                         f"{dist.get_world_size(group)}")
    release_graphs(model)
    with torch.no_grad():
        for layer in hf.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attention, name, ColumnParallelLinear.of(getattr(attention, name), shard))
            attention.o_proj = RowParallelLinear.of(attention.o_proj, shard)
            mlp.gate_proj = ColumnParallelLinear.of(mlp.gate_proj, shard)
            mlp.up_proj = ColumnParallelLinear.of(mlp.up_proj, shard)
            mlp.down_proj = RowParallelLinear.of(mlp.down_proj, shard)
        hf.lm_head = VocabParallelHead.of(hf.lm_head, shard)
    model.__dict__[DECODER_ATTRIBUTE] = functools.partial(TensorParallelLlama, shard=shard)
    return model

