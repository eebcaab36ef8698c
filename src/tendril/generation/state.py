"""What every decode loop shares: the model's graph-safe forward, its static cache, and the prompt layout.

`Decoder` is built once per `generate` call. Its tensors (cache, prompt lengths, random key) live on the
device for the whole loop, so a loop body that reads them captures as a fixed graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tendril.generation.architectures import DecoderArchitecture
from tendril.generation.cache import StaticKVCache
from tendril.generation.processors import LogitsProcessing, seen_tokens


@dataclass
class Decoder:
    arch: DecoderArchitecture
    cache: StaticKVCache
    prompt_len: int
    """P: prompt length including left padding; the first generated token goes to slot P."""
    max_new_tokens: int
    real_lengths: torch.Tensor
    """[rows] long: prompt tokens that are not padding (positions of generated tokens start there)."""
    pad_lengths: torch.Tensor
    """[rows] long: left-padding tokens per row (ignored by the repetition penalty, as in HF)."""
    processing: LogitsProcessing
    eos: torch.Tensor
    """[E] long, possibly empty (then only max_new_tokens stops a sequence)."""
    noise_key: torch.Tensor
    """0-d int64 key of the counter-based sampler (see noise.py)."""

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    @property
    def has_eos(self) -> bool:
        return self.eos.numel() > 0

    def prefill(self, prompt: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Run the prompt through the model, filling cache slots 0..P-1; logits of the last position."""
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)
        slots = torch.arange(self.prompt_len, device=prompt.device)
        return self.arch.forward(prompt, positions, slots, self.cache)

    def step(self, last_tokens: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Forward one token per row ([rows] long) stored at cache `slot` (0-d long); logits [rows, vocab]."""
        positions = self.real_lengths + (slot - self.prompt_len)
        return self.arch.forward(last_tokens[:, None], positions[:, None], slot.view(1), self.cache)

    def process(self, scores: torch.Tensor, tokens: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Apply the logits processors; `tokens` [rows, max_len] holds `length` (0-d) tokens so far."""
        seen = None
        if self.processing.uses_seen_tokens:
            slots = self.cache.slots[None, :]
            counted = (slots >= self.pad_lengths[:, None]) & (slots < length)
            seen = seen_tokens(tokens, counted, scores.shape[-1])
        return self.processing(scores, seen)

    def is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        """Elementwise: is the token one of the eos ids (all False when there are none)."""
        return (tokens[..., None] == self.eos).any(-1)
