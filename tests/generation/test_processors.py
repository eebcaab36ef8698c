"""Device-side logits processors against Hugging Face's own classes."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tendril.generation.processors import (
    LogitsProcessing,
    repetition_penalty,
    seen_tokens,
    top_k_filter,
    top_p_filter,
)

VOCAB = 50


def _scores(rows: int = 6, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(rows, VOCAB, generator=generator) * 3
    scores[0, :5] = scores[0, 5]  # ties at a top-k / top-p boundary
    return scores


@pytest.mark.parametrize("seed", range(3))
def test_repetition_penalty_matches_hf_including_ignored_left_padding(seed):
    generator = torch.Generator().manual_seed(seed)
    scores = _scores(seed=seed)
    ids = torch.randint(0, VOCAB, (6, 9), generator=generator)
    pad_lengths = torch.tensor([0, 2, 5, 0, 8, 1])
    expected = RepetitionPenaltyLogitsProcessor(1.7, prompt_ignore_length=pad_lengths)(ids, scores.clone())
    counted = torch.arange(9)[None, :] >= pad_lengths[:, None]
    got = repetition_penalty(scores, seen_tokens(ids, counted, VOCAB), 1.7)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_seen_tokens_ignores_uncounted_slots():
    ids = torch.tensor([[4, 4, 7, 9]])
    seen = seen_tokens(ids, torch.tensor([[True, True, True, False]]), 10)
    assert seen[0].nonzero().flatten().tolist() == [4, 7]


@pytest.mark.parametrize("k,keep", [(1, 1), (5, 1), (3, 4), (VOCAB + 10, 1)])
def test_top_k_matches_hf(k, keep):
    scores = _scores()
    expected = TopKLogitsWarper(k, min_tokens_to_keep=keep)(None, scores.clone())
    torch.testing.assert_close(top_k_filter(scores, max(k, keep)), expected, rtol=0, atol=0)


@pytest.mark.parametrize("p,keep", [(0.05, 1), (0.5, 1), (0.9, 2), (0.999, 1)])
def test_top_p_matches_hf(p, keep):
    scores = _scores()
    expected = TopPLogitsWarper(p, min_tokens_to_keep=keep)(None, scores.clone())
    torch.testing.assert_close(top_p_filter(scores, p, keep), expected, rtol=0, atol=0)


def test_processors_chain_in_hf_order():
    scores = _scores()
    ids = torch.randint(0, VOCAB, (6, 4), generator=torch.Generator().manual_seed(1))
    chain = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.7),
        TopKLogitsWarper(20), TopPLogitsWarper(0.8),
    ])
    expected = chain(ids, scores.clone())
    processing = LogitsProcessing(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.3)
    got = processing(scores, seen_tokens(ids, torch.ones_like(ids, dtype=torch.bool), VOCAB))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_warpers_apply_only_when_sampling():
    scores = _scores()
    greedy = LogitsProcessing(do_sample=False, temperature=0.5, top_k=3, top_p=0.5)
    assert torch.equal(greedy(scores), scores)


@pytest.mark.parametrize("bad", [dict(temperature=0.0), dict(top_k=-1), dict(top_p=1.5), dict(repetition_penalty=0)])
def test_invalid_settings_are_refused(bad):
    with pytest.raises(ValueError):
        LogitsProcessing(**bad)


def test_repetition_penalty_needs_the_seen_mask():
    with pytest.raises(ValueError, match="seen tokens"):
        LogitsProcessing(repetition_penalty=1.2)(_scores())
