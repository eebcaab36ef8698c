"""The inputs of a one-token decode step, read from the loop's state in one kernel.

A decode loop keeps its tokens in `sequences` ([rows, width]) and a step counter on the device. Each step forwards
the token at column `slot = counter + offset` of every row, at cache slot `slot` and position `position_base +
slot`. In PyTorch ops that is an add for the slot, a gather for the tokens, an add for the positions, an embedding
lookup (two and a sum with learned positions) and a lookup of the rotary table's cos and sin: five or six small
kernels, each a launch boundary at the head of every step. `_step_inputs_kernel` does all of it, one program per
row: it writes the step's first hidden state and the rotary rows, which the step's first projection and its
attention kernels read after their `gdc_wait` (`pdl.py`). The slot itself is not written: the attention kernel
computes it from the counter, which nothing in the step writes, so it may read it before its wait.

Indices are clamped into their tables (the slot into `sequences`, tokens into the vocabulary, positions into the
position tables), so that a predicated loop's body evaluated past its end reads memory it owns;
`reference.step_inputs` clamps alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import pdl as programmatic
from tendril.generation.kernels import reference

BLOCK_HIDDEN = 2048
"""Hidden features a program copies per pass (a few per thread of its 4 warps)."""


@triton.jit
def _step_inputs_kernel(sequences_ptr, stride_sr, stride_sc, width, counter_ptr, offset, base_ptr, tokens_ptr,
                        vocab, positions_ptr, rotary_ptr, stride_rotary, table_positions, hidden_ptr, hidden_size,
                        rotary_out_ptr,
                        HAS_POSITIONS: tl.constexpr, ROTARY_WIDTH: tl.constexpr, BLOCK_H: tl.constexpr,
                        BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    slot = tl.minimum(tl.maximum(tl.load(counter_ptr) + offset, 0), width - 1)
    token = tl.load(sequences_ptr + row * stride_sr + slot * stride_sc)
    token = tl.minimum(tl.maximum(token, 0), vocab - 1)
    position = tl.minimum(tl.maximum(tl.load(base_ptr + row) + slot, 0), table_positions - 1)
    DTYPE = hidden_ptr.dtype.element_ty
    for start in range(0, hidden_size, BLOCK_H):
        h = start + tl.arange(0, BLOCK_H)
        in_row = h < hidden_size
        x = tl.load(tokens_ptr + token * hidden_size + h, mask=in_row, other=0.0)
        if HAS_POSITIONS:  # one rounding of the float32 sum, as PyTorch adds half-precision tensors
            x = (x.to(tl.float32) + tl.load(positions_ptr + position * hidden_size + h, mask=in_row,
                                            other=0.0).to(tl.float32)).to(DTYPE)
        tl.store(hidden_ptr + row * hidden_size + h, x, mask=in_row)
    if ROTARY_WIDTH > 0:  # the table's row: cos then sin, ROTARY_WIDTH each
        r = tl.arange(0, BLOCK_R)
        in_rotary = r < 2 * ROTARY_WIDTH
        rows = tl.load(rotary_ptr + position * stride_rotary + r, mask=in_rotary, other=0.0)
        tl.store(rotary_out_ptr + row * 2 * ROTARY_WIDTH + r, rows, mask=in_rotary)


def step_inputs(
    sequences: torch.Tensor,
    counter: torch.Tensor,
    offset: int,
    position_base: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
    rotary: torch.Tensor | None,
    *,
    out: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`reference.step_inputs` in one kernel (same arguments and results), written into `out` (hidden [rows,
    hidden] in the token table's dtype and, with a rotary table, its rows [rows, 2, R] in that table's; contiguous) when
    given."""
    check_operands(sequences, counter, position_base, tokens, positions, rotary)
    rows, width = sequences.shape
    vocab, hidden_size = tokens.shape
    table_positions = reference.position_limit(positions, rotary)
    given_hidden, given_rows = out if out is not None else (None, None)
    if out is not None and (given_rows is None) != (rotary is None):
        raise ValueError("out's rotary rows must be given exactly when there is a rotary table")
    hidden = _output(given_hidden, (rows, hidden_size), tokens, "hidden")
    rotary_rows = None if rotary is None else _output(given_rows, (rows, 2, rotary.shape[2]), rotary, "rotary rows")
    pdl = programmatic.resolve(pdl, tokens.device, _step_inputs_kernel)
    _step_inputs_kernel[(rows,)](
        sequences, sequences.stride(0), sequences.stride(1), width, counter, offset, position_base, tokens, vocab,
        positions if positions is not None else tokens,
        rotary if rotary is not None else tokens, rotary.stride(0) if rotary is not None else 0, table_positions,
        hidden, hidden_size, rotary_rows if rotary_rows is not None else hidden,
        HAS_POSITIONS=positions is not None,
        ROTARY_WIDTH=0 if rotary is None else rotary.shape[2],
        BLOCK_H=min(triton.next_power_of_2(hidden_size), BLOCK_HIDDEN),
        BLOCK_R=1 if rotary is None else triton.next_power_of_2(2 * rotary.shape[2]),
        PDL=pdl, num_warps=4, launch_pdl=pdl,
    )  # fmt: skip
    return hidden, rotary_rows


def _output(given: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor, name: str) -> torch.Tensor:
    """`given` if it is a contiguous tensor of `shape` in `like`'s dtype (a ValueError otherwise), else a new one."""
    if given is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    if given.shape != shape or given.dtype != like.dtype or not given.is_contiguous():
        raise ValueError(f"out's {name} must be a contiguous {like.dtype} {shape} tensor, got {given.dtype} "
                         f"{tuple(given.shape)}")
    return given


def check_operands(
    sequences: torch.Tensor,
    counter: torch.Tensor,
    position_base: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor | None,
    rotary: torch.Tensor | None,
) -> None:
    """A ValueError naming the operand unless they are as `reference.step_inputs` documents."""
    rows = sequences.shape[0]
    if sequences.dim() != 2 or sequences.dtype != torch.long:
        raise ValueError(f"sequences must be an int64 [rows, width] tensor, got {sequences.dtype} "
                         f"{tuple(sequences.shape)}")
    if counter.numel() != 1 or counter.dtype != torch.long:
        raise ValueError(f"counter must be a one-element int64 tensor, got {counter.dtype} {tuple(counter.shape)}")
    if position_base.shape != (rows,) or position_base.dtype != torch.long or not position_base.is_contiguous():
        raise ValueError(f"position_base must be a contiguous int64 [{rows}] tensor, got {position_base.dtype} "
                         f"{tuple(position_base.shape)}")
    if tokens.dim() != 2 or not tokens.is_contiguous():
        raise ValueError(f"tokens must be a contiguous [vocab, hidden] table, got {tuple(tokens.shape)}")
    if positions is not None and (positions.shape[1:] != tokens.shape[1:] or positions.dtype != tokens.dtype
                                  or not positions.is_contiguous()):
        raise ValueError(f"positions must be a contiguous [positions, {tokens.shape[1]}] {tokens.dtype} table, got "
                         f"{positions.dtype} {tuple(positions.shape)}")
    if rotary is not None and (rotary.dim() != 3 or rotary.shape[1] != 2 or rotary.stride(2) != 1
                               or rotary.stride(1) != rotary.shape[2]):
        raise ValueError(f"rotary must be a [positions, 2, R] table (cos then sin) with contiguous rows, got "
                         f"{tuple(rotary.shape)} strides {rotary.stride()}")
