"""The Llama family (Llama, Mistral, Qwen2): RoPE, RMSNorm, grouped-query attention, gated MLP.

Rotary embeddings come from the model's own `rotary_emb` module and its modeling module's
`apply_rotary_pos_emb`, so each family member keeps its exact numerics.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from tendril.generation.architectures.base import (
    CacheLayout,
    DecoderArchitecture,
    last_logits,
    merge_heads,
    register,
    require,
    split_heads,
)
from tendril.generation.cache import StaticKVCache

_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}
"""RoPE types whose frequencies do not depend on the sequence length (no host decision per step)."""


@register
class Llama(DecoderArchitecture):
    model_types = ("llama", "mistral", "qwen2")

    def check(self, config: Any) -> None:
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
        require(rope_type in _STATIC_ROPE, f"RoPE type {rope_type!r} changes with the sequence length on the host; "
                f"supported: {sorted(_STATIC_ROPE)}")
        self.apply_rotary = sys.modules[type(self.model).__module__].apply_rotary_pos_emb

    def check_length(self, max_len: int) -> None:
        super().check_length(max_len)
        window: int | None = getattr(self.config, "sliding_window", None)
        if window is None:
            return
        sliding = getattr(self.config, "use_sliding_window", True)
        if self.config.model_type == "qwen2":
            sliding = "sliding_attention" in (getattr(self.config, "layer_types", None) or [])
        require(not sliding or max_len <= window,
                f"sequences of {max_len} tokens exceed the sliding window ({window}); tendril's cache attends to "
                "every earlier token, so keep prompt + max_new_tokens within the window")

    def layout(self) -> CacheLayout:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return CacheLayout(c.num_hidden_layers, c.num_key_value_heads, head_dim)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor, cache: StaticKVCache
    ) -> torch.Tensor:
        base = self.model.model
        head_dim = self.layout().head_dim
        hidden = base.embed_tokens(tokens)
        cos, sin = base.rotary_emb(hidden, positions)
        mask = cache.attention_mask(query_slots)
        for index, layer in enumerate(base.layers):
            attn = layer.self_attn
            normed = layer.input_layernorm(hidden)
            query = split_heads(attn.q_proj(normed), head_dim)
            key = split_heads(attn.k_proj(normed), head_dim)
            value = split_heads(attn.v_proj(normed), head_dim)
            query, key = self.apply_rotary(query, key, cos, sin)
            out = cache.attend(index, query, key, value, query_slots, mask, attn.scaling)
            hidden = hidden + attn.o_proj(merge_heads(out))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return last_logits(self.model.lm_head, base.norm(hidden))
