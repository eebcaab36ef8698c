"""GPT-2 (`model_type` gpt2): learned positions, fused QKV projection (Conv1D), pre-LN blocks."""

from __future__ import annotations

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


@register
class GPT2(DecoderArchitecture):
    model_types = ("gpt2",)

    def check(self, config: Any) -> None:
        require(not getattr(config, "add_cross_attention", False), "GPT-2 with cross-attention is not supported")
        require(not getattr(config, "reorder_and_upcast_attn", False),
                "GPT-2 with reorder_and_upcast_attn=True is not supported; load it with the default False")

    def layout(self) -> CacheLayout:
        c = self.config
        return CacheLayout(c.n_layer, c.n_head, c.n_embd // c.n_head)

    def _scale(self, layer: int) -> float:
        """HF's attention scale (`GPT2Attention.scaling` in recent versions, derived from the config before)."""
        scaling = getattr(self.model.transformer.h[layer].attn, "scaling", None)
        if scaling is not None:
            return float(scaling)
        c = self.config
        scale = (c.n_embd // c.n_head) ** -0.5 if c.scale_attn_weights else 1.0
        return scale / (layer + 1) if c.scale_attn_by_inverse_layer_idx else scale

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor, cache: StaticKVCache
    ) -> torch.Tensor:
        transformer = self.model.transformer
        head_dim = self.layout().head_dim
        hidden = transformer.wte(tokens) + transformer.wpe(positions)
        mask = cache.attention_mask(query_slots)
        for index, block in enumerate(transformer.h):
            attn = block.attn
            query, key, value = attn.c_attn(block.ln_1(hidden)).split(attn.split_size, dim=2)
            out = cache.attend(index, split_heads(query, head_dim), split_heads(key, head_dim),
                               split_heads(value, head_dim), query_slots, mask, self._scale(index))
            hidden = hidden + attn.c_proj(merge_heads(out))
            hidden = hidden + block.mlp(block.ln_2(hidden))
        return last_logits(self.model.lm_head, transformer.ln_f(hidden))
