"""GPT-J (`model_type` gptj): rotary embedding on the first `rotary_dim` channels (interleaved pairs),
attention and MLP in parallel from one LayerNorm.

The sin/cos table is built once with the modeling module's own `create_sinusoidal_positions` and the
rotation uses its `rotate_every_two`, with HF's formula `x * cos + rotate_every_two(x) * sin`. The
per-pair duplication of sin/cos is an `expand` here instead of HF's `repeat_interleave` (same values;
`repeat_interleave` may compute its output size on the host).

The fused step gathers sin/cos from a table of those values in the model's dtype (`RotaryTable`), rotates inside
the attention kernel (pairs, first `rotary_dim` channels) and runs five kernels a layer: LN + q/k/v, attention,
out_proj, LN + fc_in + GELU, fc_out + attention output + residual.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from tendril.generation.architectures.base import (
    CacheLayout,
    DecoderArchitecture,
    fused_attention,
    last_logits,
    last_positions,
    merge_heads,
    register,
    require,
)
from tendril.generation.architectures.fused import Embedding, FusedStep, Rotary, RotaryTable
from tendril.generation.cache import StaticKVCache
from tendril.generation.kernels import Norm, Projection, activation_for, fused_linear


@register
class GPTJ(DecoderArchitecture):
    fused_step_reads_row_table = True
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
        sin, cos = self._sin_cos(positions, hidden.dtype)
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


    def _sin_cos(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, T, 1, rotary_dim] sin and cos of `positions`, pairs duplicated, in `dtype` (as HF)."""
        sincos = self.sincos[positions].to(dtype)
        sin, cos = (_pairs(t) for t in torch.split(sincos, sincos.shape[-1] // 2, dim=-1))
        return sin, cos

    def _rotary_rows(self, x: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, rotary_dim] of positions 0..length-1 (pairs duplicated), as `_sin_cos`."""
        sin, cos = self._sin_cos(torch.arange(length, device=x.device)[None], x.dtype)
        return cos.view(length, -1), sin.view(length, -1)

    def fused_step(self) -> FusedStep:
        activation = activation_for(self.config.activation_function)
        require(activation is not None, f"step='fused' does not reproduce GPT-J's activation "
                f"{self.config.activation_function!r}; use step='compiled'")
        assert activation is not None
        transformer = self.model.transformer
        layers = [
            (Norm.of(b.ln_1), Projection.of(b.attn.q_proj, b.attn.k_proj, b.attn.v_proj),
             Projection.of(b.attn.out_proj), Projection.of(b.mlp.fc_in), Projection.of(b.mlp.fc_out))
            for b in transformer.h
        ]
        final_norm, head = Norm.of(transformer.ln_f), Projection.of(self.model.lm_head)

        def run_layers(hidden: torch.Tensor, rotary: Rotary | None, query_slots: torch.Tensor, slot_offset: int,
                       cache: StaticKVCache, rows: int) -> torch.Tensor:
            for index, (ln_1, qkv, attn_out, fc_in, fc_out) in enumerate(layers):
                query, key, value = fused_linear(hidden, qkv, norm=ln_1).split(qkv.out_sizes, dim=1)
                out = fused_attention(query, key, value, cache, index, query_slots, self.scale, rotary, slot_offset)
                attended = fused_linear(out, attn_out)
                hidden = fused_linear(fused_linear(hidden, fc_in, norm=ln_1, activation=activation), fc_out,
                                      addends=(attended, hidden))
            return fused_linear(last_positions(hidden, rows), head, norm=final_norm, out_dtype=torch.float32)

        return FusedStep(Embedding(transformer.wte, rotary=("interleaved", RotaryTable(self._rotary_rows))),
                         run_layers)


def _pairs(table: torch.Tensor) -> torch.Tensor:
    """[rows, T, n] -> [rows, T, 1, 2n] with each value twice in a row (HF's `repeat_interleave(.., 2, 3)`)."""
    rows, length, n = table.shape
    return table[:, :, None, :, None].expand(rows, length, 1, n, 2).reshape(rows, length, 1, 2 * n)
