"""Beam search's top-k (`kernels.beam_top_k`): the reference against a stable sort on the CPU, the dispatch and
its errors, its use in a beam step, and both Triton kernels compiled for sm_90 (the interpreter runs them against
the reference in test_kernels.py, through interpreted_kernels.py)."""

from __future__ import annotations

import pytest
import torch

from tendril.generation import kernels
from tendril.generation.kernels import reference
from tests.generation.topk_cases import same_values, sorted_top_k, tricky_scores


@pytest.mark.parametrize("rows, columns", [(1, 1), (1, 7), (3, 50), (2, 3000)])
def test_reference_is_a_stable_descending_sort(rows, columns):
    torch.manual_seed(columns)
    for scores in (tricky_scores(rows, columns, "cpu"), torch.full((rows, columns), float("nan")),
                   torch.full((rows, columns), float("-inf"))):
        for k in {1, min(2, columns), min(8, columns), columns}:
            values, indices = reference.beam_top_k(scores, k)
            expected = sorted_top_k(scores, k)
            assert torch.equal(indices, expected[1]) and same_values(values, expected[0]), (scores, k)
            assert values.dtype == torch.float32 and indices.dtype == torch.int64


def test_reference_keeps_the_first_of_many_ties_at_the_kth_score():
    scores = torch.tensor([[0.0, 3.0, 1.0, 1.0, 1.0, 1.0, float("nan"), 1.0, -0.0, 2.0]])
    values, indices = kernels.beam_top_k(scores, 5)  # the CPU: the reference
    assert indices.tolist() == [[6, 1, 9, 2, 3]]
    assert same_values(values, torch.tensor([[float("nan"), 3.0, 2.0, 1.0, 1.0]]))


def test_reference_values_equal_torch_topk_on_random_rows():
    torch.manual_seed(0)
    scores = torch.randn(2, 4 * 1000)
    values, indices = kernels.beam_top_k(scores, 8)
    expected = torch.topk(scores, 8)
    assert torch.equal(values, expected.values) and torch.equal(indices, expected.indices)


def test_beam_top_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="2-D float32"):
        kernels.beam_top_k(torch.zeros(4, 5, dtype=torch.float16), 2)
    with pytest.raises(ValueError, match="2-D float32"):
        kernels.beam_top_k(torch.zeros(20), 2)
    with pytest.raises(ValueError, match="k must be between 1 and the row width 5"):
        kernels.beam_top_k(torch.zeros(4, 5), 6)
    with pytest.raises(ValueError, match="k must be"):
        kernels.beam_top_k(torch.zeros(4, 5), 0)


def test_beam_steps_choose_through_beam_top_k(monkeypatch, gpt2):
    """Greedy beams and beam sampling both pick their continuations with `kernels.beam_top_k`."""
    from tendril.generation import generate
    from tests.generation.models import left_padded

    calls = []

    def counted(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append((tuple(scores.shape), k))
        return reference.beam_top_k(scores, k)

    monkeypatch.setattr(kernels, "beam_top_k", counted)
    ids, mask = left_padded([4])
    vocab = gpt2.config.vocab_size
    for sample in (False, True):
        calls.clear()
        generate(gpt2, ids, mask, max_new_tokens=3, num_beams=2, eos_token_id=[], do_sample=sample, seed=1)
        assert calls and all(call == ((1, 2 * vocab), 4) for call in calls), calls


def test_top_k_kernels_compile_for_hopper():
    """Both kernels at GPT-2's 4-beam shape (k = 8 and 16) and at a row of a few million scores (the widest
    chunk, several merge passes), PDL on: no type errors, no spills (hopper_compile.py)."""
    from tendril.generation.kernels import topk_kernel
    from tests.generation.hopper_compile import hopper_compile

    for rows, columns, k in ((1, 4 * 50257, 8), (1, 4 * 50257, 16), (2, 4_000_000, 8)):
        scores = torch.zeros(rows, columns)
        assert hopper_compile(topk_kernel._chunk_top_k_kernel, lambda scores=scores, k=k: hopper_compile(
            topk_kernel._merge_top_k_kernel, lambda: topk_kernel.beam_top_k(scores, k, pdl=True))) == 1
    assert topk_kernel.chunk_width(4 * 50257) == topk_kernel.MIN_CHUNK
    assert topk_kernel.chunk_width(4_000_000) == topk_kernel.MAX_CHUNK
    assert topk_kernel.chunk_width(37) == 64
