"""The token choice of a greedy (or Gumbel-max sampling) decode step in two kernels: the index of the largest score of
each row, as `torch.argmax(scores, -1)`, and what greedy decoding does with it (`greedy_choice`).

Greedy decoding and Gumbel-max sampling end every step with an argmax over the vocabulary (50k-150k scores a row).
One program streaming a whole row would wait for one memory round trip per chunk it can hold, a dozen or more in a
row. So the row is split: `_chunk_argmax_kernel` runs a program per `CHUNK` scores of a row, which loads its chunk
at once and stores the chunk's largest score and the smallest index holding it. NaN counts as larger than every
number, as in PyTorch (a row with several NaNs, or a NaN and +inf, may name a different one of them). Then
`_greedy_kernel`, a program per row, merges the row's chunks: the largest score, and the smallest index holding it.
So ties go to the first index, as PyTorch's. Under programmatic dependent launch (`pdl.py`) each kernel starts
during the one before and waits for it first: everything either reads is written in the step.

Around the merge, in the same kernel, is what `greedy.TokenSearch.choose` does with the token: finished rows take the
pad token, the eos test updates the rows still running, the token is written at its column of a new copy of the
sequences, and the step count goes up by one; for one row it also stores the loop's condition (steps left and the
row unfinished). Those would otherwise be about eleven PyTorch kernels, each a launch boundary of its own in the
decode loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import pdl as programmatic


@triton.jit
def _chunk_argmax_kernel(scores_ptr, stride_row, columns, best_ptr, index_ptr, chunks, CHUNK: tl.constexpr,
                         PDL: tl.constexpr):
    """Program (row, c): the largest score of the row's columns [c * CHUNK, (c + 1) * CHUNK) and the first index
    holding it (NaN largest), at [row, c] of `best` and `index` ([rows, chunks])."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = index < columns
    value = tl.load(scores_ptr + row * stride_row + index, mask=in_row, other=float("-inf"))
    value = value.to(tl.float32)  # widened first: the interpreter holds bf16 as integers, never NaN
    value = tl.where(value != value, float("inf"), value)  # NaN wins
    top = tl.max(value, axis=0)
    tl.store(best_ptr + row * chunks + chunk, top)
    tl.store(index_ptr + row * chunks + chunk, tl.min(tl.where((value == top) & in_row, index, 2147483647), axis=0))


@triton.jit
def _greedy_kernel(best_ptr, index_ptr, chunks, step_ptr, sequences_ptr, width, unfinished_ptr, eos_ptr,
                   eos_count, pad, prompt_len, max_new_tokens, tokens_ptr, new_sequences_ptr, new_unfinished_ptr,
                   new_step_ptr, running_ptr, CHUNKS: tl.constexpr, COPY: tl.constexpr, HAS_EOS: tl.constexpr,
                   ONE_ROW: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    of_row = tl.arange(0, CHUNKS)  # the row's chunks, merged: the first index of the largest score
    best = tl.load(best_ptr + row * chunks + of_row, mask=of_row < chunks, other=float("-inf"))
    first = tl.load(index_ptr + row * chunks + of_row, mask=of_row < chunks, other=2147483647)
    token = tl.min(tl.where(best == tl.max(best, axis=0), first, 2147483647), axis=0).to(tl.int64)
    step = tl.load(step_ptr)
    running = tl.load(unfinished_ptr + row) != 0
    if HAS_EOS:
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
        if ONE_ROW:  # the loop's condition: this row is all the rows there are
            tl.store(running_ptr, (running & (step + 1 < max_new_tokens)).to(tl.int8))


CHUNK = 4096
"""Scores of a row one program of `_chunk_argmax_kernel` reduces: loaded at once, 32 a thread of its 4 warps."""
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
    max_new_tokens: int,
    *,
    pdl: bool | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two kernels for a greedy step's choice: `(step + 1, sequences with the tokens written at column
    min(prompt_len + step, width - 1), unfinished after the eos test, tokens, running)`, new tensors (the inputs are
    left as they are). With eos ids, finished rows take `pad` and rows that choose an eos id stop; without,
    `unfinished` is returned as it is. `running` (0-d bool) is the decode loop's condition after the step:
    `step + 1 < max_new_tokens` and some row unfinished, stored by the second kernel for one row (two PyTorch
    kernels after it for several). `scores` [rows, vocab] float with contiguous rows; `sequences` [rows, width] long,
    contiguous; `unfinished` [rows] bool; `eos` [E] long; `step` 0-d long. `chunk` (a power of two, default
    `CHUNK`) sets the scores a program of the first kernel reduces."""
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
    running = torch.empty((), dtype=torch.bool, device=scores.device)
    if chunk is not None and (chunk < 1 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    chunk = min(triton.next_power_of_2(columns), chunk or CHUNK)
    chunks = triton.cdiv(columns, chunk)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=scores.device)
    index = torch.empty(rows, chunks, dtype=torch.int32, device=scores.device)
    pdl = programmatic.resolve(pdl, scores.device, _greedy_kernel)
    _chunk_argmax_kernel[(rows, chunks)](scores, scores.stride(0), columns, best, index, chunks, CHUNK=chunk,
                                         PDL=pdl, num_warps=4, launch_pdl=pdl)
    _greedy_kernel[(rows,)](
        best, index, chunks, step, sequences, sequences.shape[1], unfinished.view(torch.int8),
        eos if has_eos else step, eos.numel(), pad, prompt_len, max_new_tokens, tokens, new_sequences,
        new_unfinished.view(torch.int8), new_step, running.view(torch.int8),
        CHUNKS=triton.next_power_of_2(chunks), COPY=COPY_BLOCK, HAS_EOS=has_eos, ONE_ROW=rows == 1, PDL=pdl,
        num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    if rows > 1:
        running = (new_step < max_new_tokens) & new_unfinished.any()
    return new_step, new_sequences, new_unfinished, tokens, running
