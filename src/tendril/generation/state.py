"""What every decode loop shares: the model's graph-safe forward, its static cache, and the prompt layout.

A `Decoder` is built inside the generation function from its tensor inputs (prompt, attention mask,
random key), so under capture every tensor it derives (lengths, cache, masks) lives in the graph's
memory and is recomputed by each replay: nothing is decided on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tendril.generation.architectures import DecoderArchitecture
from tendril.generation.architectures.base import StepForward
from tendril.generation.architectures.fused import FusedStep
from tendril.generation.cache import StaticKVCache
from tendril.generation.processors import LogitsProcessing, seen_tokens


@dataclass
class Decoder:
    arch: DecoderArchitecture
    cache: StaticKVCache
    prompt: torch.Tensor
    """[rows, P] long, left-padded."""
    mask: torch.Tensor
    """[rows, P] long attention mask (0 for padding)."""
    max_new_tokens: int
    processing: LogitsProcessing
    eos: torch.Tensor
    """[E] long, possibly empty (then only max_new_tokens stops a sequence)."""
    noise_key: torch.Tensor
    """0-d int64 key of the counter-based sampler (see noise.py)."""
    step_forward: StepForward | None = None
    """What runs the one-token decode forward (e.g. a `torch.compile`d `arch.forward`); `arch.forward` if None."""
    prompt_forward: StepForward | None = None
    """What runs the prompt pass (a fused step, which takes prompts too); `arch.forward` if None."""

    @classmethod
    def build(
        cls,
        arch: DecoderArchitecture,
        prompt: torch.Tensor,
        mask: torch.Tensor,
        max_new_tokens: int,
        processing: LogitsProcessing,
        eos: torch.Tensor,
        noise_key: torch.Tensor,
        cache_dtype: torch.dtype,
        step_forward: StepForward | None = None,
        row_table: bool = False,
        prompt_forward: StepForward | None = None,
    ) -> Decoder:
        """`row_table`: the cache is reordered through a row table (see `StaticKVCache`); only for a
        `step_forward` that reads through it (the fused steps do)."""
        rows, prompt_len = prompt.shape
        layout = arch.layout()
        generated = torch.ones(rows, max_new_tokens, dtype=torch.bool, device=prompt.device)
        key_valid = torch.cat([mask != 0, generated], dim=1)
        cache = StaticKVCache(layout.num_layers, rows, layout.kv_heads, prompt_len + max_new_tokens, layout.head_dim,
                              cache_dtype, prompt.device, key_valid, row_table)
        return cls(arch, cache, prompt, mask, max_new_tokens, processing, eos, noise_key, step_forward, prompt_forward)

    def __post_init__(self) -> None:
        self.position_base = self.mask.sum(-1) - self.prompt_len
        """[rows] long: the real (non-padding) prompt tokens less the prompt length, so that the token at cache slot
        `s` has position `position_base + s` (one kernel per step)."""
        self.pad_lengths = (self.mask != 0).int().argmax(dim=1)
        """[rows]: left-padding tokens per row (ignored by the repetition penalty, as in HF)."""

    @property
    def prompt_len(self) -> int:
        return self.prompt.shape[1]

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    def prefill(self) -> torch.Tensor:
        """Run the prompt through the model, filling cache slots 0..P-1; logits of the last position. A fused step's
        copies of the model's weights are written first where this call's rows read them (`FusedStep.refresh`), so
        that every decode call reads the weights as they are when it runs. The positions' plain kernels stand between
        those copies and the first fused kernel, whose programmatic early start (which reads weights) overlaps only
        the kernel before it."""
        if isinstance(self.step_forward, FusedStep):
            self.step_forward.refresh(self.prompt.shape[0])
        self.cache.reset_order()
        positions = (self.mask.cumsum(-1) - 1).masked_fill(self.mask == 0, 0)
        forward = self.prompt_forward or self.arch.forward
        return forward(self.prompt, positions, self.cache.slots[: self.prompt_len], self.cache)

    def step(self, last_tokens: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Forward one token per row ([rows] long) stored at cache `slot` (0-d long); logits [rows, vocab]."""
        positions = self.position_base + slot
        forward = self.step_forward or self.arch.forward
        return forward(last_tokens[:, None], positions[:, None], slot.view(1), self.cache)

    def step_at(self, sequences: torch.Tensor, counter: torch.Tensor, offset: int) -> torch.Tensor:
        """`step` for the token at column `slot = counter + offset` of each row of `sequences` ([rows, width] long;
        `counter` 0-d long), stored at cache slot `slot`: how the decode loops call the step. A fused step
        (`FusedStep`) reads the tokens and positions from these tensors itself; other forwards get them computed."""
        forward = self.step_forward or self.arch.forward
        if isinstance(forward, FusedStep):
            return forward.step_at(sequences, counter, offset, self.position_base, self.cache)
        slot = counter + offset
        return self.step(sequences.gather(1, slot.expand(sequences.shape[0], 1)).squeeze(1), slot)

    def process(self, scores: torch.Tensor, tokens: torch.Tensor, length: torch.Tensor) -> torch.Tensor:
        """Apply the logits processors; `tokens` [rows, max_len] holds `length` (0-d) tokens so far."""
        seen = None
        if self.processing.uses_seen_tokens:
            slots = self.cache.slots[None, :]
            counted = (slots >= self.pad_lengths[:, None]) & (slots < length)
            seen = seen_tokens(tokens, counted, scores.shape[-1])
        return self.processing(scores, seen)


def is_eos(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Elementwise: is the token one of the `eos` ids ([E] long; all False when E is 0)."""
    return (tokens[..., None] == eos).any(-1)
