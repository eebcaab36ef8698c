"""Graph-safe decode paths for Hugging Face decoders, one small module per architecture family.

HF model code hides host decisions that break capture of a decode step (cache bookkeeping on the host,
masks built from Python lengths, shape-dependent branches). tendril does not capture HF's `forward`:
for each supported architecture it runs the model's *own modules and weights, unchanged*, in a short
forward written against tendril's static KV cache, with positions and cache slots held in device tensors.

Adding an architecture takes a few dozen lines (see `gpt2.py` for the shortest example):

1. subclass `DecoderArchitecture`, set `model_types` to the HF `config.model_type` values it serves;
2. implement `check` (reject configuration options the path does not reproduce, saying which),
   `layout` (layers, kv heads, head dim of the cache) and `forward` (embeddings, then per layer: the
   model's norms and projections, `cache.attend(...)` for attention, the model's MLP; then final norm
   and LM head on the last position only);
3. decorate the class with `@register`, and import its module at the bottom of this file;
4. add the model to the exactness tests in `tests/generation/test_architectures.py`, which compare
   logits and greedy/beam outputs against HF's `generate`.
"""

from __future__ import annotations

from tendril.generation.architectures.base import (
    CacheLayout,
    DecoderArchitecture,
    UnsupportedModelError,
    decoder_for,
    register,
    supported_model_types,
)

__all__ = [
    "CacheLayout",
    "DecoderArchitecture",
    "UnsupportedModelError",
    "decoder_for",
    "register",
    "supported_model_types",
]

# Registering modules: imported for their `@register` side effect.
from tendril.generation.architectures import gpt2, gptj, llama  # noqa: F401
