"""Logits processors on the device, matching Hugging Face's for the options tendril accepts.

HF applies them in this order (`GenerationMixin._get_logits_processor`): repetition penalty, then,
only when sampling, temperature, top-k and top-p. Each is a few tensor ops with no host sync. The
repetition penalty takes the set of tokens seen so far as a [rows, vocab] mask built on the device from
the static token buffer (`seen_tokens`), so it needs no variable-length `input_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LogitsProcessing:
    """The processors of one `generate` call; defaults are HF's (each is off at its default)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    """HF's default; only applied when sampling (0 turns it off)."""
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    min_tokens_to_keep: int = 1
    """HF keeps (number of eos tokens + 1) candidates in top-k/top-p under beam sampling, else 1."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}; for greedy use do_sample=False")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def uses_seen_tokens(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def changes_scores(self) -> bool:
        """Whether `__call__` does anything (else the scores pass through, and callers may skip it)."""
        return self.uses_seen_tokens or self.do_sample

    def __call__(self, scores: torch.Tensor, seen: torch.Tensor | None = None) -> torch.Tensor:
        """Processed scores [rows, vocab]; `seen` is required when the repetition penalty is on."""
        if self.uses_seen_tokens:
            if seen is None:
                raise ValueError("the repetition penalty needs the mask of seen tokens")
            scores = repetition_penalty(scores, seen, self.repetition_penalty)
        if not self.do_sample:
            return scores
        if self.temperature != 1.0:
            scores = scores / self.temperature
        if self.top_k != 0:
            scores = top_k_filter(scores, max(self.top_k, self.min_tokens_to_keep))
        if self.top_p < 1.0:
            scores = top_p_filter(scores, self.top_p, self.min_tokens_to_keep)
        return scores


def seen_tokens(tokens: torch.Tensor, counted: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool: which ids occur in `tokens` [rows, L] where `counted` [rows, L] is True."""
    ids = torch.where(counted, tokens.clamp(max=vocab_size), vocab_size)
    mask = torch.zeros(tokens.shape[0], vocab_size + 1, dtype=torch.bool, device=tokens.device)
    return mask.scatter_(1, ids, True)[:, :vocab_size]


def repetition_penalty(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty as HF applies it: seen tokens' scores are divided by `penalty` (multiplied if < 0)."""
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def top_k_filter(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set to -inf every score below the k-th largest (ties with it are kept, as in HF)."""
    k = min(top_k, scores.shape[-1])
    threshold = torch.topk(scores, k)[0][..., -1:]
    return scores.masked_fill(scores < threshold, float("-inf"))


def top_p_filter(scores: torch.Tensor, top_p: float, min_tokens_to_keep: int = 1) -> torch.Tensor:
    """Nucleus filtering as HF does it: drop the smallest tokens whose total probability is <= 1 - top_p."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -min_tokens_to_keep:] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, float("-inf"))
