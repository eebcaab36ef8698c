"""The architecture interface and its registry (model_type -> graph-safe decode path)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tendril.generation.cache import StaticKVCache
from tendril.generation.kernels import decode_attention, prompt_attention


class UnsupportedModelError(ValueError):
    """The model (or one of its configuration options) has no graph-safe decode path in tendril."""


@dataclass(frozen=True)
class CacheLayout:
    num_layers: int
    kv_heads: int
    head_dim: int


StepForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StaticKVCache], torch.Tensor]
"""(tokens [rows, T], positions [rows, T], query_slots [T], cache) -> float32 logits of the last token [rows, vocab]:
a decode step (T = 1) or, for forwards that take one (the fused ones), a prompt (`Decoder.prefill`)."""


class DecoderArchitecture(ABC):
    """A forward of one HF causal LM over tendril's static KV cache, reusing the model's modules.

    `forward` must be capturable: no host syncs, no Python branches on tensor values; every shape it
    sees depends only on (rows, T), never on the step.
    """

    model_types: ClassVar[tuple[str, ...]] = ()
    fused_step_reads_row_table: ClassVar[bool] = False
    """True when `fused_step`'s attention reads the cache through `StaticKVCache.source_rows` (when it is not
    None), so beam search may reorder the table instead of copying the cache."""

    def __init__(self, model: nn.Module) -> None:
        self.model: Any = model
        self.config: Any = model.config
        self.check(self.config)

    def check(self, config: Any) -> None:  # noqa: B027 (optional hook)
        """Raise `UnsupportedModelError` for configuration options this path does not reproduce."""

    def check_length(self, max_len: int) -> None:
        """Raise if sequences of `max_len` tokens (prompt + new) exceed what the model supports."""
        limit = getattr(self.config, "max_position_embeddings", None) or getattr(self.config, "n_positions", None)
        if limit is not None and max_len > limit:
            raise ValueError(f"prompt length + max_new_tokens = {max_len} exceeds the model's {limit} positions; "
                             "lower max_new_tokens or shorten the prompt")

    @abstractmethod
    def layout(self) -> CacheLayout:
        """Shape of the per-layer key/value cache."""

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, query_slots: torch.Tensor, cache: StaticKVCache
    ) -> torch.Tensor:
        """Logits of the last position, float32 [rows, vocab].

        tokens, positions: [rows, T] long; query_slots: [T] long, the cache slots these tokens occupy.
        """

    def fused_step(self) -> StepForward:
        """`forward` for one-token steps through tendril's fused kernels (`generation.kernels`): per layer
        one kernel per projection (norm, bias, activation and residual fused in) and one attention kernel
        (cache write included, `fused_attention`). It also runs a prompt into an empty cache, the same kernels over
        every token of every row (`Decoder.prefill`). Built once per model; raises `UnsupportedModelError` when the
        architecture (or one of its options) has no fused path."""
        raise UnsupportedModelError(f"step='fused' has no fused decode kernels for {type(self).__name__} "
                                    f"(model types {', '.join(self.model_types)}); use step='compiled'")


_REGISTRY: dict[str, type[DecoderArchitecture]] = {}


def register(cls: type[DecoderArchitecture]) -> type[DecoderArchitecture]:
    """Class decorator: serve `cls.model_types` with `cls`."""
    if not cls.model_types:
        raise ValueError(f"{cls.__name__}.model_types is empty")
    for model_type in cls.model_types:
        if model_type in _REGISTRY:
            raise ValueError(f"model_type {model_type!r} registered twice ({_REGISTRY[model_type].__name__})")
        _REGISTRY[model_type] = cls
    return cls


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


DECODER_ATTRIBUTE = "tendril_decoder"
"""A model whose `__dict__` holds a callable under this name is decoded by `callable(model)` instead of the
registry's path for its model type (how `tendril.distributed` gives a tensor-parallel shard its decode path)."""


def decoder_for(model: nn.Module) -> DecoderArchitecture:
    """The graph-safe decode path for `model`, or `UnsupportedModelError` saying what is supported."""
    own_decoder = model.__dict__.get(DECODER_ATTRIBUTE)
    if own_decoder is not None:
        return own_decoder(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    cls = _REGISTRY.get(model_type) if isinstance(model_type, str) else None
    if cls is None:
        raise UnsupportedModelError(
            f"tendril.generate has no graph-safe decode path for model_type {model_type!r} "
            f"({type(model).__name__}); supported: {', '.join(supported_model_types())}. Pass "
            "unsupported='hf' to run Hugging Face's generate eagerly instead, or add the architecture "
            "(see tendril/generation/architectures/__init__.py)."
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{type(model).__name__} is an encoder-decoder model; only decoders are supported")
    return cls(model)


def require(condition: bool, message: str) -> None:
    """`check` helper: raise `UnsupportedModelError(message)` unless `condition`."""
    if not condition:
        raise UnsupportedModelError(message)


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[rows, T, heads * head_dim] -> [rows, heads, T, head_dim]."""
    rows, length, _ = x.shape
    return x.view(rows, length, -1, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[rows, heads, T, head_dim] -> [rows, T, heads * head_dim]."""
    rows, _, length, _ = x.shape
    return x.transpose(1, 2).reshape(rows, length, -1)


def fused_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cache: StaticKVCache,
    layer: int,
    query_slots: torch.Tensor,
    scale: float,
    rotary: tuple[str, torch.Tensor, torch.Tensor] | None = None,
    slot_offset: int = 0,
) -> torch.Tensor:
    """A fused forward's attention in `layer` for `query` ([rows * T, heads * head_dim], T tokens a row): one token a
    row is a decode step at `query_slots + slot_offset` (`decode_attention`, through the cache's row table); several
    are the prompt, at slots 0..T-1 of an empty cache, as `Decoder.prefill` passes it (`prompt_attention`)."""
    keys, values = cache.keys[layer], cache.values[layer]
    rows = keys.shape[0]
    if query.shape[0] == rows:
        return decode_attention(query, key, value, keys, values, cache.key_valid, query_slots, scale, rotary,
                                source_rows=cache.source_rows, slot_offset=slot_offset)
    if slot_offset:
        raise ValueError(f"a prompt fills slots 0..T-1 of an empty cache; slot_offset must be 0, got {slot_offset}")
    if query.shape[0] != rows * query_slots.numel():
        raise ValueError(f"{query.shape[0]} query tokens for {rows} rows at {query_slots.numel()} slots: a fused "
                         f"forward takes one token a row, or a prompt of one token a slot")
    return prompt_attention(query, key, value, keys, values, cache.key_valid, scale, rotary)


def last_positions(hidden: torch.Tensor, rows: int) -> torch.Tensor:
    """The last token of each row of a fused forward's `hidden` ([rows * T, width]), as [rows, width]."""
    return hidden.view(rows, -1, hidden.shape[-1])[:, -1]


def last_logits(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
    """The LM head on the last position only, as float32 [rows, vocab] (what HF's generate uses)."""
    return lm_head(hidden[:, -1]).float()
