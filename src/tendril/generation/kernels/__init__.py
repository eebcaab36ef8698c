"""Fused kernels of one-token decode steps and short prompt passes (`generate(step="fused")`).

`linear.py` (norm + projection + activation + residual adds; `launch.py` its default launch), `attention.py` (cache
write + rotary + attention of one query over the static cache), `prompt_kernel.py` (the same for a short prompt into
an empty cache), `argmax_kernel.py` (the token choice, alone or with the rest of a greedy step's bookkeeping),
`topk_kernel.py` (beam search's top-k over all beams), `reference.py` (plain PyTorch with the same numerics),
`layers.py` (norms and projections read from HF modules), `step_inputs_kernel.py` (a step's embedding and rotary
rows read from the loop's state), `pdl.py` (how consecutive kernels overlap). The functions here run the Triton
kernels on CUDA tensors and the references elsewhere (the CPU), so a fused decode path runs, slowly, without a GPU;
on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`) they run the kernels (that is how CI tests them without
a GPU).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

import torch

from tendril.generation.kernels import reference
from tendril.generation.kernels.layers import Norm, Projection, activation_for

__all__ = [
    "Norm",
    "Projection",
    "activation_for",
    "beam_top_k",
    "decode_attention",
    "fused_linear",
    "greedy_choice",
    "prompt_attention",
    "step_inputs",
]


def _use_triton(x: torch.Tensor) -> bool:
    if x.is_cuda:
        return True
    if importlib.util.find_spec("triton") is None:
        return False
    from tendril.generation.kernels import attention

    return attention.INTERPRETED


def fused_linear(
    x: torch.Tensor,
    projection: Projection,
    *,
    norm: Norm | None = None,
    activation: str = "none",
    gated: bool = False,
    addends: Sequence[torch.Tensor] = (),
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`addends + act(projection(norm(x)))` ([rows, in] -> [rows, out]); see `reference.fused_linear`.
    `out_dtype=torch.float32` returns the result (rounded to x's dtype) widened, as `.float()` would,
    without a kernel of its own."""
    if _use_triton(x):
        from tendril.generation.kernels import linear

        return linear.fused_linear(x, projection, norm=norm, activation=activation, gated=gated, addends=addends,
                                   out_dtype=out_dtype)
    result = reference.fused_linear(x, projection, norm=norm, activation=activation, gated=gated, addends=addends)
    return result if out_dtype is None else result.to(out_dtype)


def step_inputs(
    sequences: torch.Tensor,
    counter: torch.Tensor,
    offset: int,
    position_base: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor | None = None,
    rotary: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A one-token step's first hidden state and rotary rows from the loop's state; see `reference.step_inputs`.
    One Triton kernel on CUDA (`step_inputs_kernel.py`)."""
    if _use_triton(tokens):
        from tendril.generation.kernels import step_inputs_kernel

        return step_inputs_kernel.step_inputs(sequences, counter, offset, position_base, tokens, positions, rotary)
    return reference.step_inputs(sequences, counter, offset, position_base, tokens, positions, rotary)


def greedy_choice(
    scores: torch.Tensor,
    step: torch.Tensor,
    sequences: torch.Tensor,
    unfinished: torch.Tensor,
    eos: torch.Tensor,
    pad: int,
    prompt_len: int,
    max_new_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy (or Gumbel-max sampling) step's choice from its final scores: `(step + 1, sequences with the
    tokens written, unfinished after the eos test, tokens, whether the loop goes on)`; two Triton kernels on CUDA
    (`argmax_kernel.py`), `reference.greedy_choice` elsewhere."""
    if _use_triton(scores) and scores.dim() == 2 and scores.stride(1) == 1 and sequences.is_contiguous():
        from tendril.generation.kernels import argmax_kernel

        return argmax_kernel.greedy_choice(scores, step, sequences, unfinished, eos, pad, prompt_len, max_new_tokens)
    return reference.greedy_choice(scores, step, sequences, unfinished, eos, pad, prompt_len, max_new_tokens)


def beam_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row of `scores` ([rows, n] float32) and their indices, as `torch.topk(scores,
    k)` returns them (values float32, indices int64, largest first, NaN above every number), except that equal
    scores come in index order, on every device (`torch.topk` leaves their order unspecified). Two Triton kernels
    on CUDA, no host synchronisation (`topk_kernel.py`); `reference.beam_top_k` elsewhere."""
    if scores.dim() != 2 or scores.dtype != torch.float32:
        raise ValueError(f"scores must be a 2-D float32 tensor, got {scores.dtype} {tuple(scores.shape)}")
    if not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k must be between 1 and the row width {scores.shape[1]}, got {k}")
    if _use_triton(scores):
        from tendril.generation.kernels import topk_kernel

        return topk_kernel.beam_top_k(scores if scores.stride(1) == 1 else scores.contiguous(), k)
    return reference.beam_top_k(scores, k)


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    slot: torch.Tensor,
    scale: float,
    rotary: tuple[str, torch.Tensor, torch.Tensor] | None = None,
    *,
    source_rows: torch.Tensor | None = None,
    slot_offset: int = 0,
) -> torch.Tensor:
    """One query token per row over the static cache, writing its key and value at `slot + slot_offset`, reading
    earlier slots through `source_rows` when given; see `reference.decode_attention`."""
    if _use_triton(q):
        from tendril.generation.kernels import attention

        return attention.decode_attention(q, k, v, keys, values, key_valid, slot, scale, rotary,
                                          source_rows=source_rows, slot_offset=slot_offset)
    return reference.decode_attention(q, k, v, keys, values, key_valid, slot, scale, rotary, source_rows=source_rows,
                                      slot_offset=slot_offset)


def prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_valid: torch.Tensor,
    scale: float,
    rotary: tuple[str, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """A prompt of a few tokens per row into an empty cache (slots 0..P-1), each token attending to the valid tokens
    before it and itself; see `reference.prompt_attention`."""
    if _use_triton(q):
        from tendril.generation.kernels import prompt_kernel

        return prompt_kernel.prompt_attention(q, k, v, keys, values, key_valid, scale, rotary)
    return reference.prompt_attention(q, k, v, keys, values, key_valid, scale, rotary)
