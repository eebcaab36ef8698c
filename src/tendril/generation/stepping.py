"""The body of a decode loop run one token at a time, outside the loop: for profiling and per-step graphs.

`generate` runs every token inside one device-side loop, so a profiler sees the whole loop at once.
`decode_step` gives the same loop's body on its own: the state after the prompt pass in fixed buffers, and a
`step()` that advances it by one token in place, which can be timed or captured as a CUDA graph by itself
(what the kernels of one token cost, what a host loop of per-token replays costs). Copies of the model's weights that a
fused step holds are written again by every prompt pass (construction, `restart`), not per `step()`.
"""

from __future__ import annotations

import torch
from torch import nn

from tendril.generation.api import _architecture, _check_inputs, _check_integers, _check_prompt, decode_loop
from tendril.generation.loop import DecodeLoop, Plan, Step
from tendril.generation.noise import draw_key
from tendril.generation.processors import LogitsProcessing
from tendril.graphs.control.loops import assign_state


class DecodeStep:
    """A decode loop's carried state in fixed buffers, advanced one loop iteration (one token) per `step()`.

    After construction `buffers` hold the state after the prompt pass and the first token choice (for greedy
    search: step counter, sequences, unfinished flags, whether the loop goes on); `reset()` puts that state back,
    `restart(prompt)` runs the prompt pass again for another prompt of the same shape. The buffers are inference
    tensors (the loop runs under `torch.inference_mode`, as `generate` does), so every method writes them in
    inference mode. It runs the model's tensors as they were when it was made: after replacing or moving them, make
    a new one (`generate` notices such changes itself, `tendril.graphs.module_state`).
    """

    def __init__(self, loop: DecodeLoop, prompt: torch.Tensor, seed: int = 0) -> None:
        self.loop = loop
        with torch.inference_mode():
            self.search = loop.search(prompt.clone(), torch.ones_like(prompt), draw_key(prompt.device, seed))
            self.start = [t.clone() for t in self.search.start(self.search.decoder.prefill())]
            self.buffers = [t.clone() for t in self.start]
        self.max_new_tokens = self.search.decoder.max_new_tokens
        """The cache holds this many new tokens: the first from the prompt pass, one per `step()` after it."""

    def step(self) -> None:
        """Advance the state by one loop body (capturable: it writes the buffers in place, reading nothing else, as the
        decode loop's conditional node writes its state: `while_loop`'s `assign_state`)."""
        with torch.inference_mode():
            assign_state(self.buffers, self.search.body(*self.buffers))

    def reset(self) -> None:
        """Put back the state after the construction's prompt pass."""
        with torch.inference_mode():
            assign_state(self.buffers, self.start)

    def restart(self, prompt: torch.Tensor) -> None:
        """Run the prompt pass for `prompt` (the construction's shape, before repeating for beams) into the buffers."""
        decoder = self.search.decoder
        with torch.inference_mode():
            decoder.prompt.copy_(prompt.repeat_interleave(decoder.prompt.shape[0] // prompt.shape[0], dim=0))
            assign_state(self.buffers, self.search.start(decoder.prefill()))


def decode_step(
    model: nn.Module, prompt: torch.Tensor, *, max_new_tokens: int, num_beams: int = 1, step: Step = "eager"
) -> DecodeStep:
    """The body of the loop `generate(model, prompt, max_new_tokens=..., num_beams=..., step=..., eos_token_id=[],
    pad_token_id=0)` runs, on its own: greedy or beam search with HF's other defaults, no eos, an all-ones mask.

    The loop is the one `generate` built for those options (built here if it was not), so a compiled or fused
    step is shared with `generate`'s. `prompt` is [batch, length] int64 on the model's device, checked as `generate`
    checks its prompt.
    """
    _check_inputs(prompt, None, max_new_tokens)
    _check_integers(num_beams=num_beams)
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    _check_prompt(model, prompt, None, [], 0)
    _architecture(model).check_length(prompt.shape[1] + max_new_tokens)
    plan = Plan.build(max_new_tokens=max_new_tokens, processing=LogitsProcessing(), eos=(), pad=0,
                      num_beams=num_beams, step=step)
    rows = prompt.repeat_interleave(num_beams, dim=0)
    return DecodeStep(decode_loop(model, plan), rows)
