"""On the GPU: beam search's top-k kernels (`topk_kernel.py`) against the reference and a stable sort (ties, -inf,
NaN, odd widths, GPT-2's 4-beam row and wider), against `torch.topk` on random rows inside a captured CUDA graph
replayed with new data, and the two launches a call makes."""

from __future__ import annotations

import pytest
import torch

from tendril.generation import kernels
from tendril.generation.kernels import topk_kernel
from tests.generation.topk_cases import check_beam_top_k, check_one_top_k, tricky_scores

pytestmark = pytest.mark.gpu
GPT2_BEAMS = 4 * 50257
"""GPT-2's 4-beam step: one row of every beam's scores."""


def test_top_k_kernels_match_the_reference():
    wide = (GPT2_BEAMS, 3 * topk_kernel.MAX_CHUNK + 5, 151_936 * 8, 3_000_001)
    assert check_beam_top_k("cuda", columns=(5, 37, 1000, 2500, *wide)) > 0


@pytest.mark.parametrize("columns", [GPT2_BEAMS, 3_000_001])
@pytest.mark.parametrize("k", [16, 64])
def test_top_k_kernels_match_the_reference_for_larger_k(columns, k):
    torch.manual_seed(k)
    check_one_top_k(tricky_scores(3, columns, "cuda"), k)


def _beam_scores(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Scores as a beam step makes them: each beam's log-probabilities plus the beam's running score."""
    logits = torch.randn(rows, 4, 50257, device="cuda", generator=generator) * 3
    running = torch.randn(rows, 4, 1, device="cuda", generator=generator) * 2
    return (logits.log_softmax(-1) + running).view(rows, GPT2_BEAMS)


def _assert_like_torch_topk(scores: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, k: int) -> None:
    expected = torch.topk(scores, k)
    assert torch.equal(values, expected.values)
    assert torch.equal(scores.gather(1, indices), values)
    unique = (scores[:, None, :] == values[:, :, None]).sum(-1) == 1  # equal scores may come in another order
    assert torch.equal(indices[unique], expected.indices[unique])


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("k", [8, 16])
def test_top_k_in_a_cuda_graph_matches_torch_topk(rows, k):
    generator = torch.Generator(device="cuda").manual_seed(rows * 100 + k)
    scores = _beam_scores(rows, generator)
    kernels.beam_top_k(scores, k)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        values, indices = kernels.beam_top_k(scores, k)
    for _ in range(2):
        scores.copy_(_beam_scores(rows, generator))
        values.fill_(float("nan"))
        indices.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert values.dtype == torch.float32 and indices.dtype == torch.int64
        _assert_like_torch_topk(scores, values, indices, k)


def test_top_k_launches_two_kernels():
    scores = torch.randn(1, GPT2_BEAMS, device="cuda")
    kernels.beam_top_k(scores, 8)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        kernels.beam_top_k(scores, 8)
        torch.cuda.synchronize()
    launched = [event.name for event in profile.events() if event.device_type == torch.autograd.DeviceType.CUDA]
    assert sorted(launched) == ["_chunk_top_k_kernel", "_merge_top_k_kernel"], launched
