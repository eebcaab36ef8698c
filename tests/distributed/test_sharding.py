"""What `shard_llama` gives each rank (no processes): exact slices, refused sizes, a one-rank shard unchanged."""

from __future__ import annotations

import pytest
import torch

import tendril
from tendril.distributed import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelLlama,
    VocabParallelHead,
    shard_llama,
)
from tendril.generation import loop
from tendril.generation.api import decode_loop
from tendril.generation.loop import Plan
from tendril.generation.processors import LogitsProcessing
from tests.distributed.ranks import RUNS, decode
from tests.generation.models import tiny_model


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_holds_its_heads_and_features(rank):
    whole = tiny_model("qwen2")  # q/k/v with biases
    shard = shard_llama(tiny_model("qwen2"), rank, 2)
    heads, kv_heads, head_dim = 4, 2, 16
    q_rows = slice(rank * heads // 2 * head_dim, (rank + 1) * heads // 2 * head_dim)
    kv_rows = slice(rank * kv_heads // 2 * head_dim, (rank + 1) * kv_heads // 2 * head_dim)
    ffn = slice(rank * 64, (rank + 1) * 64)
    for full, part in zip(whole.model.layers, shard.model.layers, strict=True):
        attention, mlp = part.self_attn, part.mlp
        assert isinstance(attention.q_proj, ColumnParallelLinear) and isinstance(mlp.down_proj, RowParallelLinear)
        assert torch.equal(attention.q_proj.weight, full.self_attn.q_proj.weight[q_rows])
        assert torch.equal(attention.q_proj.bias, full.self_attn.q_proj.bias[q_rows])
        for name in ("k_proj", "v_proj"):
            assert torch.equal(getattr(attention, name).weight, getattr(full.self_attn, name).weight[kv_rows])
            assert torch.equal(getattr(attention, name).bias, getattr(full.self_attn, name).bias[kv_rows])
        assert torch.equal(attention.o_proj.weight, full.self_attn.o_proj.weight[:, q_rows])
        assert torch.equal(mlp.gate_proj.weight, full.mlp.gate_proj.weight[ffn])
        assert torch.equal(mlp.up_proj.weight, full.mlp.up_proj.weight[ffn])
        assert torch.equal(mlp.down_proj.weight, full.mlp.down_proj.weight[:, ffn])
        assert torch.equal(part.input_layernorm.weight, full.input_layernorm.weight)
    assert isinstance(shard.lm_head, VocabParallelHead)
    assert torch.equal(shard.lm_head.weight, whole.lm_head.weight[rank * 48 : (rank + 1) * 48])
    assert torch.equal(shard.model.embed_tokens.weight, whole.model.embed_tokens.weight)


def test_the_cache_of_a_rank_holds_its_kv_heads():
    model = shard_llama(tiny_model("llama"), 0, 2)
    arch = model.tendril_decoder(model)
    assert isinstance(arch, TensorParallelLlama)
    assert arch.layout().kv_heads == 1


@pytest.mark.parametrize(
    "rank, world, match",
    [(0, 3, "num_attention_heads = 4, num_key_value_heads = 2"), (0, 4, "num_key_value_heads = 2"),
     (2, 2, "rank must lie in"), (0, 0, "rank must lie in")],
)
def test_sizes_the_ranks_cannot_split_are_refused(rank, world, match):
    with pytest.raises(ValueError, match=match):
        shard_llama(tiny_model("llama"), rank, world)


def test_other_architectures_and_second_shardings_are_refused():
    with pytest.raises(ValueError, match="Llama family"):
        shard_llama(tiny_model("gpt2"), 0, 1)
    model = shard_llama(tiny_model("llama"), 0, 1)
    with pytest.raises(ValueError, match="sharded already"):
        shard_llama(model, 0, 1)


def test_a_shard_of_several_ranks_needs_a_process_group():
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises((ValueError, RuntimeError), match="init_process_group"):
        tendril.generate(shard_llama(tiny_model("llama"), 0, 2), ids, max_new_tokens=2)


@pytest.mark.parametrize("name", list(RUNS))
def test_a_one_rank_shard_decodes_as_the_model(name, monkeypatch):
    monkeypatch.setattr(loop, "COMPILE_BACKEND", "eager")
    family, options = RUNS[name]
    assert torch.equal(decode(shard_llama(tiny_model(family), 0, 1), options), decode(tiny_model(family), options))


def test_sharding_releases_the_decode_paths_built_before():
    model = tiny_model("llama")
    plan = Plan.build(max_new_tokens=2, processing=LogitsProcessing(), eos=(), pad=0, step="fused")
    assert not isinstance(decode_loop(model, plan).arch, TensorParallelLlama)
    shard_llama(model, 0, 1)
    assert isinstance(decode_loop(model, plan).arch, TensorParallelLlama)
