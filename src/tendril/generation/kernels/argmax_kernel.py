"""The token choice of a greedy (or Gumbel-max sampling) decode step in one kernel, one program per row: the index
of the largest score, as `torch.argmax(scores, -1)`, and what greedy decoding does with it (`greedy_choice`).

Greedy decoding and Gumbel-max sampling end every step with an argmax over the vocabulary (50k-150k
scores a row). PyTorch's reduction of one such row is slower than any projection of the step but the LM
head (see the generation profile in `benchmarks/results/`). Here each program
streams its row in `BLOCK` wide chunks, keeping per lane the best score seen and its index (a later
chunk replaces it only when strictly larger, so each lane keeps the first of equal scores), then reduces
the lanes: the largest score, and the smallest index holding it. So ties go to the first index, as
PyTorch's. NaN counts as larger than every number, also as in PyTorch; a row with several NaNs (or a NaN
and +inf) may name a different one of them. Under programmatic dependent launch (`pdl.py`) it starts
during the LM head and waits for it first.

Around the argmax, in the same kernel, is what `greedy.TokenSearch.choose` does with the token: finished rows
take the pad token, the eos test updates the rows still running, the token is written at its column of a new copy
of the sequences, and the step count goes up by one. Those would otherwise be about eight PyTorch kernels, each a
launch boundary of its own in the decode loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import pdl as programmatic


@triton.jit
def _row_argmax(scores_ptr, stride_row, columns, row, BLOCK: tl.constexpr):
    """int32 index of the first largest score of `row` (see the module docstring)."""
    lanes = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_index = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    for start in range(0, columns, BLOCK):
        index = start + lanes
        value = tl.load(scores_ptr + row * stride_row + index, mask=index < columns, other=float("-inf"))
        value = value.to(tl.float32)  # widened first: the interpreter holds bf16 as integers, never NaN
        value = tl.where(value != value, float("inf"), value)  # NaN wins
        better = (value > best) | ((best_index == 2147483647) & (index < columns))
        best = tl.where(better, value, best)
        best_index = tl.where(better, index, best_index)
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_index, 2147483647), axis=0)


@triton.jit
def _greedy_kernel(scores_ptr, stride_row, columns, step_ptr, sequences_ptr, width, unfinished_ptr, eos_ptr,
                   eos_count, pad, prompt_len, tokens_ptr, new_sequences_ptr, new_unfinished_ptr, new_step_ptr,
                   BLOCK: tl.constexpr, COPY: tl.constexpr, HAS_EOS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    token = _row_argmax(scores_ptr, stride_row, columns, row, BLOCK).to(tl.int64)
    step = tl.load(step_ptr)
    if HAS_EOS:
        running = tl.load(unfinished_ptr + row) != 0
        token = tl.where(running, token, pad)
        for e in range(eos_count):
            running = running & (token != tl.load(eos_ptr + e))
        tl.store(new_unfinished_ptr + row, running.to(tl.int8))
    tl.store(tokens_ptr + row, token)
    column = tl.minimum(prompt_len + step, width - 1)
    lanes = tl.arange(0, COPY)
    for start in range(0, width, COPY):
        index = start + lanes
        value = tl.load(sequences_ptr + row * width + index, mask=index < width)
        tl.store(new_sequences_ptr + row * width + index, tl.where(index == column, token, value), mask=index < width)
    if row == 0:
        tl.store(new_step_ptr, step + 1)


MAX_BLOCK = 8192
"""Widest chunk, streamed by 32 warps (a chunk as wide as a whole vocabulary row is much slower)."""
COPY_BLOCK = 256
"""Columns of the sequences copied per pass."""


def greedy_choice(
    scores: torch.Tensor,
    step: torch.Tensor,
    sequences: torch.Tensor,
    unfinished: torch.Tensor,
    eos: torch.Tensor,
    pad: int,
    prompt_len: int,
    *,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel for a greedy step's choice: `(step + 1, sequences with the tokens written at column
    min(prompt_len + step, width - 1), unfinished after the eos test, tokens)`, new tensors (the inputs are left
    as they are). With eos ids, finished rows take `pad` and rows that choose an eos id stop; without, `unfinished`
    is returned as it is. `scores` [rows, vocab] float with contiguous rows; `sequences` [rows, width] long,
    contiguous; `unfinished` [rows] bool; `eos` [E] long; `step` 0-d long."""
    if scores.dim() != 2 or scores.stride(1) != 1 or not scores.is_floating_point():
        raise ValueError(f"scores must be a 2-D float tensor with contiguous rows, got {scores.dtype} "
                         f"{tuple(scores.shape)} strides {scores.stride()}")
    rows, columns = scores.shape
    if columns == 0:
        raise ValueError("argmax of an empty row")
    if sequences.shape[0] != rows or not sequences.is_contiguous() or sequences.dtype != torch.long:
        raise ValueError(f"sequences must be a contiguous long tensor of {rows} rows, got {sequences.dtype} "
                         f"{tuple(sequences.shape)}")
    tokens = torch.empty(rows, dtype=torch.long, device=scores.device)
    new_sequences = torch.empty_like(sequences)
    has_eos = eos.numel() > 0  # without eos ids the kernel reads none; an empty tensor has no address to pass, so
    # `step` (of the same dtype) stands in for them
    new_unfinished = torch.empty_like(unfinished) if has_eos else unfinished
    new_step = torch.empty_like(step)
    pdl = programmatic.resolve(pdl, scores.device, _greedy_kernel)
    block = min(triton.next_power_of_2(columns), MAX_BLOCK)
    _greedy_kernel[(rows,)](
        scores, scores.stride(0), columns, step, sequences, sequences.shape[1], unfinished.view(torch.int8),
        eos if has_eos else step, eos.numel(), pad, prompt_len, tokens, new_sequences, new_unfinished.view(torch.int8),
        new_step,
        BLOCK=block, COPY=COPY_BLOCK, HAS_EOS=has_eos, PDL=pdl, num_warps=32 if block == MAX_BLOCK else 4,
        launch_pdl=pdl,
    )  # fmt: skip
    return new_step, new_sequences, new_unfinished, tokens
