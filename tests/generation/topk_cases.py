"""Checks of beam search's top-k kernels (`topk_kernel.py`) against `reference.beam_top_k` and a stable sort,
shared by the interpreter run (CPU) and the GPU tests: rows of one to three, widths inside one chunk, across several
(the last one short) and, with the kernel's sizes shrunk, across many chunks and several merge passes; ties
(rounded scores, where -0.0 and +0.0 tie too), -inf, NaN; outputs poisoned with NaN and -1 first."""

from __future__ import annotations

import torch

from tendril.generation.kernels import reference, topk_kernel


def sorted_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract in its plainest form: a stable descending sort of whole rows (NaN first), then the first k."""
    values, indices = scores.sort(dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def same_values(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal bit for bit up to NaN payloads (NaN where the other has NaN, every other value equal, -0.0 and +0.0
    told apart)."""
    nan = got.isnan()
    if not torch.equal(nan, expected.isnan()):
        return False
    bits = got.masked_fill(nan, 0).view(torch.int32), expected.masked_fill(nan, 0).view(torch.int32)
    return torch.equal(*bits)


NANS = (0x7FC00000, -0x00400000, 0x7F800001)
"""float32 bits of NaNs: PyTorch's, one with the sign bit set, one with another payload (all rank alike)."""


def tricky_scores(rows: int, columns: int, device: str) -> torch.Tensor:
    """Random scores; row 0 rounded (many ties), row 1 with every third score -inf and NaNs of several bit
    patterns, row 2 zeros of alternating sign (which tie) but for its last score."""
    scores = torch.randn(rows, columns, device=device)
    scores[0] = scores[0].round()
    if rows > 1:
        scores[1, ::3] = float("-inf")
        places = torch.randperm(columns, device=device)[: len(NANS)]
        nans = torch.tensor(NANS, dtype=torch.int32, device=device).view(torch.float32)
        scores[1, places] = nans[: len(places)]
    if rows > 2:
        scores[2] = 0.0
        scores[2, ::2] = -0.0
        scores[2, -1] = 2.0
    return scores


def check_one_top_k(scores: torch.Tensor, k: int) -> None:
    """The kernels' top k of `scores` into poisoned outputs equal the reference's and the sort's exactly."""
    rows = scores.shape[0]
    values = torch.full((rows, k), float("nan"), device=scores.device)
    indices = torch.full((rows, k), -1, dtype=torch.long, device=scores.device)
    got = topk_kernel.beam_top_k(scores, k, out=(values, indices))
    assert got[0] is values and got[1] is indices
    values, indices = values.cpu(), indices.cpu()
    # the sort runs on the CPU, where it ranks NaNs of every bit pattern alike
    for expected in (tuple(t.cpu() for t in reference.beam_top_k(scores, k)), sorted_top_k(scores.cpu(), k)):
        assert torch.equal(indices, expected[1]), (tuple(scores.shape), k, indices, expected[1])
        assert same_values(values, expected[0]), (tuple(scores.shape), k, values, expected[0])


def check_beam_top_k(device: str, columns: tuple[int, ...] = (5, 37, 1000, 2500)) -> int:
    """The kernels equal the reference and a stable sort exactly, on `columns` wide rows (k = 1, 2, 8; every row's
    candidates in one merge block, held in registers) and, with chunks of 16 scores and merge passes of 64
    candidates, on 700 wide rows (44 chunks, the last short; k = 3 and 8: 3 and 6 passes a round, the last short)."""
    torch.manual_seed(4)
    checked = 0
    for width in columns:
        for rows in (1, 3):
            scores = tricky_scores(rows, width, device)
            for k in (1, 2, 8):
                if k <= width:
                    check_one_top_k(scores, k)
                    checked += 1
    sizes = topk_kernel.MIN_CHUNK, topk_kernel.MERGE_BLOCK
    topk_kernel.MIN_CHUNK, topk_kernel.MERGE_BLOCK = 16, 64
    try:
        scores = tricky_scores(2, 700, device)
        assert topk_kernel.chunk_width(700) == 16
        for k in (3, 8):
            check_one_top_k(scores, k)
            checked += 1
    finally:
        topk_kernel.MIN_CHUNK, topk_kernel.MERGE_BLOCK = sizes
    return checked
