"""GPT-2 (`model_type` gpt2): learned positions, fused QKV projection (Conv1D), pre-LN blocks.

Its fused step runs five kernels a layer: LN1 + QKV, attention (cache write included), output projection
+ residual, LN2 + FC + GELU, MLP projection + residual; then the final LN with the LM head. Its one-token and beam steps
read K-contiguous copies of the Conv1D weights (`Projection.with_copies`), which double the layers' weight memory
(`TENDRIL_WEIGHT_COPIES=0`: none).
"""

from __future__ import annotations

from typing import Any

import torch

from tendril import config
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
from tendril.generation.architectures.fused import Embedding, FusedStep, Rotary
from tendril.generation.cache import StaticKVCache
from tendril.generation.kernels import Norm, Projection, activation_for, fused_linear


@register
class GPT2(DecoderArchitecture):
    fused_step_reads_row_table = True
    model_types = ("gpt2",)

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self._copied_projections: dict[int, tuple[tuple[int, torch.dtype, torch.device], Projection]] = {}
        """Per Conv1D module (by id): its weight's storage (address, dtype, device) and the projection with
        copies built from it (`_conv1d`)."""

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

    def _conv1d(self, module: Any) -> Projection:
        """The projection of a Conv1D module with its copies (`Projection.with_copies`), shared by every
        decode loop of the model (each would otherwise hold copies of its own); built again when the module's weight
        has new storage (the model was cast or moved), which replaces the module's entry. Without copies when
        `tendril.settings.weight_copies` is off."""
        if not config.settings.weight_copies:
            return Projection.of(module)
        weight = module.weight
        storage = (weight.data_ptr(), weight.dtype, weight.device)
        entry = self._copied_projections.get(id(module))
        if entry is None or entry[0] != storage:
            entry = self._copied_projections[id(module)] = (storage, Projection.of(module).with_copies())
        return entry[1]

    def fused_step(self) -> FusedStep:
        activation = activation_for(self.config.activation_function)
        require(activation is not None, f"step='fused' does not reproduce GPT-2's activation "
                f"{self.config.activation_function!r}; use step='compiled'")
        assert activation is not None
        transformer = self.model.transformer
        conv1d = self._conv1d
        layers = [
            (Norm.of(b.ln_1), conv1d(b.attn.c_attn), conv1d(b.attn.c_proj), Norm.of(b.ln_2), conv1d(b.mlp.c_fc),
             conv1d(b.mlp.c_proj), self._scale(i))
            for i, b in enumerate(transformer.h)
        ]
        final_norm, head = Norm.of(transformer.ln_f), Projection.of(self.model.lm_head)

        def run_layers(hidden: torch.Tensor, rotary: Rotary | None, query_slots: torch.Tensor, slot_offset: int,
                       cache: StaticKVCache, rows: int) -> torch.Tensor:
            width = hidden.shape[-1]
            for index, (ln_1, qkv, attn_out, ln_2, fc, mlp_out, scale) in enumerate(layers):
                query, key, value = fused_linear(hidden, qkv, norm=ln_1).split(width, dim=1)
                out = fused_attention(query, key, value, cache, index, query_slots, scale, slot_offset=slot_offset)
                hidden = fused_linear(out, attn_out, addends=(hidden,))
                hidden = fused_linear(fused_linear(hidden, fc, norm=ln_2, activation=activation), mlp_out,
                                      addends=(hidden,))
            return fused_linear(last_positions(hidden, rows), head, norm=final_norm, out_dtype=torch.float32)

        copied = [p for layer in layers for p in layer if isinstance(p, Projection)]
        return FusedStep(Embedding(transformer.wte, transformer.wpe), run_layers, copied)
