"""The Llama family (Llama, Mistral, Qwen2): RoPE, RMSNorm, grouped-query attention, gated MLP.

Rotary embeddings come from the model's own `rotary_emb` module and its modeling module's
`apply_rotary_pos_emb`, so each family member keeps its exact numerics. The fused step gathers cos/sin
from a table the same `rotary_emb` computes once (`RotaryTable`) and rotates inside the attention kernel (with
HF's fp16 roundings); five kernels a layer: RMSNorm + q/k/v, attention, o_proj + residual, RMSNorm + gate/up +
act * up, down + residual.
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
    split_heads,
)
from tendril.generation.architectures.fused import Embedding, FusedStep, Rotary, RotaryTable
from tendril.generation.cache import StaticKVCache
from tendril.generation.kernels import Norm, Projection, activation_for, fused_linear

FusedLayer = tuple[Norm, Projection, Projection, Norm, Projection, Projection, float]
"""One decoder layer as the fused step reads it (see `Llama.fused_weights`)."""


class Unsharded:
    """How the fused step combines a layer's outputs when one device holds the whole model: each row projection
    adds the residual itself, and nothing is reduced or gathered. `tendril.distributed.Shard` is the
    tensor-parallel counterpart (a reduction after each row-parallel projection, a gather of the logits)."""

    @staticmethod
    def residual(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (hidden,)

    @staticmethod
    def reduce(partial: torch.Tensor) -> torch.Tensor:
        return partial

    @staticmethod
    def gather(local: torch.Tensor) -> torch.Tensor:
        return local


_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}
"""RoPE types whose frequencies do not depend on the sequence length (no host decision per step)."""


@register
class Llama(DecoderArchitecture):
    fused_step_reads_row_table = True
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

    def fused_weights(self) -> tuple[str, list[FusedLayer], Norm, Projection]:
        """What the fused step reads: the kernels' activation, per layer (input norm, q/k/v, o_proj,
        post-attention norm, gate/up, down, attention scale), the final norm and the LM head. Raises
        `UnsupportedModelError` when the model has no fused path."""
        activation = activation_for(self.config.hidden_act)
        require(activation is not None, f"step='fused' does not reproduce the activation "
                f"{self.config.hidden_act!r}; use step='compiled'")
        assert activation is not None
        base = self.model.model
        for layer in base.layers:
            require(all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")),
                    f"step='fused' expects a gated MLP (gate/up/down projections), got "
                    f"{type(layer.mlp).__name__}; use step='compiled'")
        layers = [
            (Norm.of(layer.input_layernorm),
             Projection.of(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
             Projection.of(layer.self_attn.o_proj), Norm.of(layer.post_attention_layernorm),
             Projection.of(layer.mlp.gate_proj, layer.mlp.up_proj), Projection.of(layer.mlp.down_proj),
             float(layer.self_attn.scaling))
            for layer in base.layers
        ]
        return activation, layers, Norm.of(base.norm), Projection.of(self.model.lm_head)

    parallel: Any = Unsharded
    """How row projections combine across devices (`Unsharded`, or a `tendril.distributed.Shard`)."""

    def _rotary_rows(self, x: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [length, head_dim] of positions 0..length-1, from the model's `rotary_emb`."""
        cos, sin = self.model.model.rotary_emb(x, torch.arange(length, device=x.device)[None])
        return cos[0], sin[0]

    def fused_step(self) -> FusedStep:
        activation, layers, final_norm, head = self.fused_weights()
        base = self.model.model
        parallel = self.parallel

        def run_layers(hidden: torch.Tensor, rotary: Rotary | None, query_slots: torch.Tensor, slot_offset: int,
                       cache: StaticKVCache, rows: int) -> torch.Tensor:
            for index, (norm_1, qkv, attn_out, norm_2, gate_up, down, scale) in enumerate(layers):
                query, key, value = fused_linear(hidden, qkv, norm=norm_1).split(qkv.out_sizes, dim=1)
                out = fused_attention(query, key, value, cache, index, query_slots, scale, rotary, slot_offset)
                hidden = parallel.reduce(fused_linear(out, attn_out, addends=parallel.residual(hidden)))
                gated = fused_linear(hidden, gate_up, norm=norm_2, activation=activation, gated=True)
                hidden = parallel.reduce(fused_linear(gated, down, addends=parallel.residual(hidden)))
            last = last_positions(hidden, rows)
            return parallel.gather(fused_linear(last, head, norm=final_norm, out_dtype=torch.float32))

        return FusedStep(Embedding(base.embed_tokens, rotary=("half", RotaryTable(self._rotary_rows))), run_layers)
