"""Fully graphed generation: greedy, sampling and beam search decoded by a device-side loop.

Layout: `cache.py` (tendril's static KV cache), `architectures/` (graph-safe forwards reusing HF modules:
GPT-2, GPT-J, Llama/Mistral/Qwen2), `processors.py` (HF's logits processors on the device), `noise.py`
(counter-based sampling noise), `greedy.py` and `beam.py` (the loop bodies, run by
`tendril.graphs.control.while_loop`), `api.py` (`generate`, graphed per input shape on CUDA).
"""

from __future__ import annotations

from tendril.generation.api import generate
from tendril.generation.architectures import UnsupportedModelError, supported_model_types

__all__ = ["UnsupportedModelError", "generate", "supported_model_types"]
