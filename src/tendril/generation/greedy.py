"""Greedy decoding and multinomial sampling as a device loop (HF's `_sample`).

Carried state: (step, sequences, unfinished, running):
- step: 0-d long, tokens generated so far;
- sequences: [rows, P + max_new_tokens] long, the prompt then the generated tokens (pad beyond);
- unfinished: [rows] bool, rows that have not produced eos (finished rows emit the pad token, as HF);
- running: 0-d bool, `step < max_new_tokens` and some row is unfinished: the loop's condition, computed with the
  choice that changes it (in the token choice's kernel at batch 1), so testing it takes no kernel of its own.
The loop runs while `running`; one iteration forwards the last token, processes the logits, picks the next
token and updates the stop mask and the condition, all on the device.

With a `TokenRing`, each chosen token of the (single) row is also published for a streamer (see
`streaming.py`); without one the loop is unchanged.

The body is also safe to evaluate on a finished state (predicated loops do that and discard the result):
indices are clamped into range and the cache write it repeats is idempotent.
"""

from __future__ import annotations

import torch

from tendril.generation import kernels
from tendril.generation.noise import gumbel
from tendril.generation.state import Decoder
from tendril.generation.streaming import TokenRing

Carried = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class TokenSearch:
    """cond/body/start of greedy decoding or sampling over one `Decoder` (its cache, prompt and options)."""

    def __init__(self, decoder: Decoder, pad_token_id: int, ring: TokenRing | None = None) -> None:
        self.decoder = decoder
        self.pad_token_id = pad_token_id
        self.ring = ring

    def start(self, prefill_logits: torch.Tensor) -> Carried:
        """The state after choosing the first token from the prompt's logits."""
        prompt = self.decoder.prompt
        rows, device = prompt.shape[0], prompt.device
        sequences = torch.full((rows, self.decoder.max_len), self.pad_token_id, dtype=torch.long, device=device)
        sequences[:, : self.decoder.prompt_len] = prompt
        step = torch.zeros((), dtype=torch.long, device=device)
        unfinished = torch.ones(rows, dtype=torch.bool, device=device)
        running = torch.full((), self.decoder.max_new_tokens > 0, dtype=torch.bool, device=device)
        return self.choose(prefill_logits, step, sequences, unfinished, running)

    def cond(self, step: torch.Tensor, sequences: torch.Tensor, unfinished: torch.Tensor,
             running: torch.Tensor) -> torch.Tensor:
        return running

    def body(self, step: torch.Tensor, sequences: torch.Tensor, unfinished: torch.Tensor,
             running: torch.Tensor) -> Carried:
        # the last token written, at column prompt_len + step - 1
        logits = self.decoder.step_at(sequences, step, self.decoder.prompt_len - 1)
        return self.choose(logits, step, sequences, unfinished, running)

    def choose(self, logits: torch.Tensor, step: torch.Tensor, sequences: torch.Tensor, unfinished: torch.Tensor,
               running: torch.Tensor) -> Carried:
        decoder = self.decoder
        scores = logits
        if decoder.processing.changes_scores:
            length = (decoder.prompt_len + step).clamp(max=decoder.max_len - 1)
            scores = decoder.process(scores, sequences, length)
        if decoder.processing.do_sample:
            scores = scores + gumbel(decoder.noise_key, step, *scores.shape)
        next_step, written, still_unfinished, tokens, still_running = kernels.greedy_choice(
            scores, step, sequences, unfinished, decoder.eos, self.pad_token_id, decoder.prompt_len,
            decoder.max_new_tokens,
        )
        if self.ring is not None:  # publish only while the loop runs (a predicated body also runs after it stops)
            self.ring.publish(running, next_step, tokens[:1])
        return next_step, written, still_unfinished, still_running


def greedy_result(carried: tuple[torch.Tensor, ...], prompt_len: int) -> torch.Tensor:
    """The prompt and generated tokens, cropped to the steps run (one host sync, after the loop)."""
    step, sequences = carried[:2]
    return sequences[:, : prompt_len + int(step.item())]
