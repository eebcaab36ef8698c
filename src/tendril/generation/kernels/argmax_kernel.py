"""Index of the largest score per row, as `torch.argmax(scores, -1)`: one program per row, one kernel.

Greedy decoding and Gumbel-max sampling end every step with an argmax over the vocabulary (50k-150k
scores a row). PyTorch's reduction of one such row is slower than any projection of the step but the LM
head (see the generation profile in `benchmarks/results/`). Here each program
streams its row in `BLOCK` wide chunks, keeping per lane the best score seen and its index (a later
chunk replaces it only when strictly larger, so each lane keeps the first of equal scores), then reduces
the lanes: the largest score, and the smallest index holding it. So ties go to the first index, as
PyTorch's. NaN counts as larger than every number, also as in PyTorch; a row with several NaNs (or a NaN
and +inf) may name a different one of them. Under programmatic dependent launch (`pdl.py`) it starts
during the LM head and waits for it first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import pdl as programmatic


@triton.jit
def _argmax_kernel(scores_ptr, stride_row, columns, out_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
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
    first = tl.min(tl.where(best == top, best_index, 2147483647), axis=0)
    tl.store(out_ptr + row, first.to(tl.int64))


MAX_BLOCK = 8192
"""Widest chunk, streamed by 32 warps (a chunk as wide as a whole vocabulary row is much slower)."""


def argmax(scores: torch.Tensor, *, pdl: bool | None = None) -> torch.Tensor:
    """int64 [rows]: `scores.argmax(-1)` of a 2-D float tensor with contiguous rows."""
    if scores.dim() != 2 or scores.stride(1) != 1 or not scores.is_floating_point():
        raise ValueError(f"scores must be a 2-D float tensor with contiguous rows, got {scores.dtype} "
                         f"{tuple(scores.shape)} strides {scores.stride()}")
    rows, columns = scores.shape
    if columns == 0:
        raise ValueError("argmax of an empty row")
    out = torch.empty(rows, dtype=torch.long, device=scores.device)
    pdl = programmatic.resolve(pdl, scores.device, _argmax_kernel)
    block = min(triton.next_power_of_2(columns), MAX_BLOCK)
    _argmax_kernel[(rows,)](scores, scores.stride(0), columns, out, BLOCK=block, PDL=pdl,
                            num_warps=32 if block == MAX_BLOCK else 4, launch_pdl=pdl)
    return out
