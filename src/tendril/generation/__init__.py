"""Fully graphed generation: greedy, sampling and beam search decoded by a device-side loop.

Layout: `cache.py` (tendril's static KV cache), `architectures/` (graph-safe forwards reusing HF modules:
GPT-2, GPT-J, Llama/Mistral/Qwen2), `processors.py` (HF's logits processors on the device), `noise.py`
(counter-based sampling noise), `greedy.py` and `beam.py` (the loop bodies), `loop.py` (the
`while_loop` they run in), `api.py` (`generate`).
"""

from __future__ import annotations

from tendril.generation.api import generate
from tendril.generation.architectures import UnsupportedModelError, supported_model_types
from tendril.generation.loop import loop_backend

__all__ = ["UnsupportedModelError", "generate", "loop_backend", "supported_model_types"]
