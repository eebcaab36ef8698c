"""What several demo sections share: the GPT-2 they graph, and how they report running without a GPU."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from tendril.graphs.admission import GraphFallbackWarning
from tendril.graphs.callable import graphed


def gpt2(device: torch.device) -> tuple[torch.nn.Module, int]:
    """GPT-2 124M in fp16 on a GPU; elsewhere a 2-layer fp32 model small enough to run quickly on a CPU.
    Random weights, no KV cache. Returns the model and its vocabulary size."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if device.type == "cuda":
        config, dtype = GPT2Config(use_cache=False), torch.float16
    else:
        config, dtype = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, use_cache=False), torch.float32
    model: torch.nn.Module = GPT2LMHeadModel(config)
    return model.to(device=device, dtype=dtype).eval(), config.vocab_size


def eager_fallback_note(model: torch.nn.Module, example: tuple[Any, ...], **options: Any) -> str:
    """Call `tendril.graphed(model, **options)` once where it cannot graph, and say why it ran eagerly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphFallbackWarning)
        fast = graphed(model, **options)
        fast(*example)
    reason = next(iter(fast.stats.fallback_details.values()))
    return f"tendril.graphed runs eagerly here ({reason}); graphs need an NVIDIA GPU."
