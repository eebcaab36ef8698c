"""The k largest scores of each row of a wide float32 tensor, in two kernels: beam search's step b.

Each beam-search step picks its continuations by a top-k over all beams' scores at once (a row of
`num_beams * vocab` scores per batch item, k twice the number of beams). PyTorch selects that many from such a
row by a multi-block radix select, a chain of small kernels per call: inside a CUDA graph each kernel boundary
costs a launch gap of its own, and together they can cost more than the rest of a small model's step. Here it is
two kernels whatever the sizes, with no host synchronisation and no data-dependent shapes, so it captures as is:

1. `_chunk_top_k_kernel`, a grid of (chunk, row) programs: each loads its `CHUNK` scores of the row into registers
   and writes their k largest to a scratch tensor `[rows, chunks, k]`;
2. `_merge_top_k_kernel`, one program per row: the k largest of the row's `chunks * k` candidates, in order,
   as (value, index) pairs. Candidates that fit one block (`MERGE_BLOCK`) are loaded once and every round
   selects from registers; more are streamed from memory once a round.

Both select by k rounds of a maximum. Each score becomes one int64 *order key*: its float32 bits mapped to an
int32 whose signed order is the floats' (a NaN, any NaN, above +inf, as `torch.topk` orders it; -0.0 as +0.0, which
compare equal), times 2**32, plus `2**31 - 1 - index`. Keys are distinct, they order by score and then by the
lower index first, and one integer maximum finds both the largest score and its first index. Round r takes the
largest key below round r - 1's, so nothing is marked as taken and the merge can stream its candidates from
memory. A round's key carries the index; the value is read back from `scores`, so it keeps its exact bits.

Ties are broken by the lower index (deterministic, the same on every device and in `reference.beam_top_k`);
`torch.topk` leaves the order of equal scores unspecified.

Chunk size: wide enough that a row's chunks are a few hundred at the beam-search sizes (a hundred thousand to a
few million scores a row), which gives every SM of a large GPU a program or two in the first kernel, and leaves
the merge a few thousand candidates; never narrower than `MIN_CHUNK`, below which the rounds (whose cost hardly
depends on the chunk's width) would dominate and the merge would grow for nothing, nor wider than `MAX_CHUNK`, so
that a chunk's keys stay in registers (wider rows have more chunks, whose candidates the merge streams in passes
of `MERGE_BLOCK`). A row narrower than `MIN_CHUNK` is a single chunk of its own width. Under
programmatic dependent launch (`pdl.py`) each kernel starts while the one before it runs and waits for it before
reading anything.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tendril.generation.kernels import pdl as programmatic

_NO_KEY: tl.constexpr = tl.constexpr(-9223372036854775807)
"""Below every key of a score (masked lanes, a chunk with fewer than k scores)."""
_ABOVE_ALL: tl.constexpr = tl.constexpr(9223372036854775807)
"""Above every key: the bound of the first round."""

TARGET_CHUNKS = 256
"""Chunks per row the chunk width aims at (the width is a power of two, so between half and all of this)."""
MIN_CHUNK = 1024
"""Narrowest chunk of a row wider than it."""
MAX_CHUNK = 8192
"""Widest chunk: 16 warps holding 16 keys a thread."""
MERGE_BLOCK = 2048
"""Candidates the merge compares per pass (8 warps)."""
MAX_COLUMNS = 2**30
"""Widest row: indices and chunk offsets stay int32."""


@triton.jit
def _order_keys(value, index, columns):
    """int64 order keys of float32 `value` at column `index` (see the module docstring); `_NO_KEY` past `columns`."""
    value = tl.where(value == 0.0, 0.0, value)  # -0.0 ties +0.0
    bits = value.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits reversed
    key = tl.where(value != value, 0x7FFFFFFF, key)  # every NaN above +inf
    packed = (key.to(tl.int64) << 32) | (2147483647 - index).to(tl.int64)  # lower index, larger key
    return tl.where(index < columns, packed, _NO_KEY)


@triton.jit
def _chunk_top_k_kernel(scores_ptr, stride_row, columns, k, candidates_ptr, CHUNK: tl.constexpr,
                        PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    index = chunk * CHUNK + tl.arange(0, CHUNK)
    value = tl.load(scores_ptr + row * stride_row + index, mask=index < columns, other=0.0)
    keys = _order_keys(value, index, columns)
    out = candidates_ptr + (row * tl.num_programs(0) + chunk) * k
    bound = tl.full([], _ABOVE_ALL, tl.int64)
    for r in range(k):
        bound = tl.max(tl.where(keys < bound, keys, _NO_KEY), axis=0)
        tl.store(out + r, bound)


@triton.jit
def _merge_top_k_kernel(candidates_ptr, count, k, scores_ptr, stride_row, values_ptr, indices_ptr,
                        BLOCK: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK)
    bound = tl.full([], _ABOVE_ALL, tl.int64)
    if ONE_PASS:
        held = tl.load(candidates_ptr + row * count + lanes, mask=lanes < count, other=_NO_KEY)
    for r in range(k):
        if ONE_PASS:  # every candidate in registers: no round waits for memory
            bound = tl.max(tl.where(held < bound, held, _NO_KEY), axis=0)
        else:
            best = tl.full([BLOCK], _NO_KEY, tl.int64)
            for start in range(0, count, BLOCK):
                keys = tl.load(candidates_ptr + row * count + start + lanes, mask=start + lanes < count,
                               other=_NO_KEY)
                best = tl.maximum(best, tl.where(keys < bound, keys, _NO_KEY))
            bound = tl.max(best, axis=0)
        index = 2147483647 - (bound & 0x7FFFFFFF)
        tl.store(values_ptr + row * k + r, tl.load(scores_ptr + row * stride_row + index))
        tl.store(indices_ptr + row * k + r, index)


def chunk_width(columns: int) -> int:
    """Scores per program of the first kernel for rows of `columns` scores (see the module docstring)."""
    aimed = min(max(triton.next_power_of_2(triton.cdiv(columns, TARGET_CHUNKS)), MIN_CHUNK), MAX_CHUNK)
    return min(aimed, triton.next_power_of_2(columns))


def beam_top_k(
    scores: torch.Tensor,
    k: int,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of each row of `scores` ([rows, n] float32, contiguous rows) and their indices:
    `(values [rows, k] float32, indices [rows, k] int64)`, largest first, equal scores in index order, NaN above
    every number. Into `out` (contiguous tensors of those shapes and dtypes) when given, else new tensors; two
    kernel launches, no host synchronisation (capturable)."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(f"scores must be a 2-D float32 tensor with contiguous rows, got {scores.dtype} "
                         f"{tuple(scores.shape)} strides {scores.stride()}")
    rows, columns = scores.shape
    if not 1 <= k <= columns:
        raise ValueError(f"k must be between 1 and the row width {columns}, got {k}")
    if columns > MAX_COLUMNS:
        raise ValueError(f"scores rows must be at most {MAX_COLUMNS} wide, got {columns}")
    chunk = chunk_width(columns)
    chunks = triton.cdiv(columns, chunk)
    candidates = torch.empty(rows, chunks, k, dtype=torch.int64, device=scores.device)
    values, indices = out if out is not None else (
        torch.empty(rows, k, dtype=torch.float32, device=scores.device),
        torch.empty(rows, k, dtype=torch.int64, device=scores.device),
    )
    for tensor, dtype in ((values, torch.float32), (indices, torch.int64)):
        if tensor.shape != (rows, k) or tensor.dtype != dtype or not tensor.is_contiguous():
            raise ValueError(f"out must be contiguous [{rows}, {k}] float32 and int64 tensors, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
    pdl = programmatic.resolve(pdl, scores.device, _chunk_top_k_kernel)
    _chunk_top_k_kernel[(chunks, rows)](
        scores, scores.stride(0), columns, k, candidates,
        CHUNK=chunk, PDL=pdl, num_warps=min(max(chunk // 256, 1), 16), launch_pdl=pdl,
    )  # fmt: skip
    merge_block = min(triton.next_power_of_2(chunks * k), MERGE_BLOCK)
    _merge_top_k_kernel[(rows,)](
        candidates, chunks * k, k, scores, scores.stride(0), values, indices,
        BLOCK=merge_block, ONE_PASS=chunks * k <= merge_block, PDL=pdl, num_warps=min(max(merge_block // 256, 1), 8),
        launch_pdl=pdl,
    )  # fmt: skip
    return values, indices
