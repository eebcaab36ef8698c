"""GPT-J (`model_type` gptj): rotary embedding on the first `rotary_dim` channels (interleaved pairs),
attention and MLP in parallel from one LayerNorm.

The sin/cos table is built once with the modeling module's own `create_sinusoidal_positions` and the
rotation uses its `rotate_every_two`, with HF's formula `x * cos + rotate_every_two(x) * sin`. The
per-pair duplication of sin/cos is an `expand` here instead of HF's `repeat_interleave` (same values;
`repeat_interleave` may compute its output size on the host).
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
)
from tendril.generation.cache import StaticKVCache


@register
class GPTJ(DecoderArchitecture):
    model_types = ("gptj",)

    def check(self, config: Any) -> None:
        modeling = sys.modules[type(self.model).__module__]
        self.rotate_every_two = modeling.rotate_every_two
        head_dim = config.n_embd // config.n_head
        self.rotary_dim = config.rotary_dim or config.n_embd
        weight = self.model.transformer.wte.weight
        self.sincos = modeling.create_sinusoidal_positions(config.n_positions, self.rotary_dim).to(weight.device)
        self.scale = head_dim**-0.5

    def layout(self) -> CacheLayout:
        c = self.config
        return CacheLayout(c.n_layer, c.n_head, c.n_embd // c.n_head)

    def _rotate(self, x: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor) -> torch.Tensor:
        """x: [rows, T, heads, head_dim]; sin, cos: [rows, T, 1, rotary_dim] (pairs duplicated)."""
        part = x[..., : self.rotary_dim]
        rotated = (part * cos) + (self.rotate_every_two(part) * sin)
        return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor, cache: StaticKVCache
    ) -> torch.Tensor:
        transformer = self.model.transformer
        rows, length = tokens.shape
        head_dim = self.layout().head_dim
        hidden = transformer.wte(tokens)
        sincos = self.sincos[positions].to(hidden.dtype)
        sin, cos = (_pairs(t) for t in torch.split(sincos, sincos.shape[-1] // 2, dim=-1))
        mask = cache.attention_mask(query_slots)
        for index, block in enumerate(transformer.h):
            attn = block.attn
            normed = block.ln_1(hidden)
            query = self._rotate(attn.q_proj(normed).view(rows, length, -1, head_dim), sin, cos).transpose(1, 2)
            key = self._rotate(attn.k_proj(normed).view(rows, length, -1, head_dim), sin, cos).transpose(1, 2)
            value = attn.v_proj(normed).view(rows, length, -1, head_dim).transpose(1, 2)
            out = cache.attend(index, query, key, value, query_slots, mask, self.scale)
            hidden = hidden + attn.out_proj(merge_heads(out)) + block.mlp(normed)
        return last_logits(self.model.lm_head, transformer.ln_f(hidden))


def _pairs(table: torch.Tensor) -> torch.Tensor:
    """[rows, T, n] -> [rows, T, 1, 2n] with each value twice in a row (HF's `repeat_interleave(.., 2, 3)`)."""
    rows, length, n = table.shape
    return table[:, :, None, :, None].expand(rows, length, 1, n, 2).reshape(rows, length, 1, 2 * n)
