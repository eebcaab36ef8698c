"""Each graph-safe decode path against the HF model's own forward (fp32, left padding, several steps)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tendril.generation.architectures import UnsupportedModelError, decoder_for, supported_model_types
from tendril.generation.cache import StaticKVCache
from tests.generation.models import VOCAB, left_padded, tiny_model

FAMILIES = ["gpt2", "gptj", "llama", "mistral", "qwen2"]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_steps_match_hf_logits(family):
    model = tiny_model(family)
    arch = decoder_for(model)
    ids, mask = left_padded([5, 3, 1])
    steps, max_len = 3, ids.shape[1] + 3
    layout = arch.layout()
    key_valid = torch.cat([mask.bool(), torch.ones(3, steps, dtype=torch.bool)], dim=1)
    cache = StaticKVCache(layout.num_layers, 3, layout.kv_heads, max_len, layout.head_dim, torch.float32,
                          torch.device("cpu"), key_valid)
    with torch.no_grad():
        logits = arch.forward(ids, _positions(mask), torch.arange(ids.shape[1]), cache)
        for step in range(steps + 1):
            expected = model(ids, attention_mask=mask, position_ids=_positions(mask)).logits[:, -1]
            torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
            if step == steps:
                break
            token = torch.randint(4, VOCAB, (3, 1), generator=torch.Generator().manual_seed(step))
            slot = torch.tensor([ids.shape[1]])
            ids, mask = torch.cat([ids, token], 1), torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            logits = arch.forward(token, _positions(mask)[:, -1:], slot, cache)


def test_registry_lists_the_families():
    assert {"gpt2", "gptj", "llama", "mistral", "qwen2"} <= set(supported_model_types())


def test_unsupported_model_names_what_is_supported():
    model = transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, ffn_dim=64, num_attention_heads=2,
        word_embed_proj_dim=32))
    with pytest.raises(UnsupportedModelError, match=r"'opt'.*supported: .*gpt2.*unsupported='hf'"):
        decoder_for(model)


def test_unsupported_options_are_refused_by_name():
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, reorder_and_upcast_attn=True)
    with pytest.raises(UnsupportedModelError, match="reorder_and_upcast_attn"):
        decoder_for(transformers.GPT2LMHeadModel(config))
    rope = transformers.LlamaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                    vocab_size=VOCAB, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModelError, match="dynamic"):
        decoder_for(transformers.LlamaForCausalLM(rope))


def test_lengths_beyond_the_model_or_window_are_refused():
    with pytest.raises(ValueError, match="exceeds the model's 128 positions"):
        decoder_for(tiny_model("gpt2")).check_length(129)
    mistral = tiny_model("mistral")
    mistral.config.sliding_window = 16
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        decoder_for(mistral).check_length(17)


def test_gpt2_scale_is_derived_from_the_config_where_hf_has_no_scaling_attribute():
    model = tiny_model("gpt2")
    model.config.scale_attn_by_inverse_layer_idx = True
    arch = decoder_for(model)
    from_hf = [arch._scale(layer) for layer in range(2)]
    for block in model.transformer.h:
        del block.attn.scaling
    assert [arch._scale(layer) for layer in range(2)] == pytest.approx([(16**-0.5), (16**-0.5) / 2])
    assert from_hf == pytest.approx([16**-0.5, 16**-0.5])  # HF computed its scaling when the model was built


@pytest.mark.parametrize("rope", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_rotary_table_holds_what_the_model_computes_per_step(rope, dtype):
    from tendril.generation.architectures.fused import RotaryTable

    model = tiny_model("llama")
    if rope is not None:
        config = model.config
        config.rope_parameters = {**rope, "rope_theta": 10000.0}
        model = transformers.LlamaForCausalLM(config).eval()
    rotary_emb = model.model.rotary_emb
    table = RotaryTable(decoder_for(model)._rotary_rows)
    x = torch.zeros(3, 1, 64, dtype=dtype)
    for length in (9, 5, 30):  # a table for a longer cache, a shorter one served from a longer table
        positions = torch.randint(0, length, (3, 1))
        cos, sin = table(x, positions, length)
        expected_cos, expected_sin = rotary_emb(x, positions)
        assert cos.dtype == dtype and torch.equal(cos, expected_cos[:, 0]) and torch.equal(sin, expected_sin[:, 0])
    # the first table stays: a graph captured with it would go on reading it
    assert [t.shape[0] for t in table.tables] == [9, 30]
