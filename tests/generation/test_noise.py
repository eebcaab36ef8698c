"""The counter-based sampler: a pure function of (key, step, row, column), uniform, and exact in law."""

from __future__ import annotations

import torch

from tendril.generation.noise import draw_key, gumbel, hash32, uniform


def _step(value: int) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.long)


def test_hash32_matches_the_reference_lowbias32():
    def reference(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF]
    assert hash32(torch.tensor(values)).tolist() == [reference(v) for v in values]


def test_uniform_is_deterministic_in_range_and_distinct_per_step_and_row():
    key = draw_key(torch.device("cpu"), seed=7)
    assert torch.equal(key, draw_key(torch.device("cpu"), seed=7))
    a = uniform(key, _step(3), 4, 1000)
    assert torch.equal(a, uniform(key, _step(3), 4, 1000))
    assert a.min() > 0 and a.max() < 1
    assert not torch.equal(a, uniform(key, _step(4), 4, 1000))
    assert not torch.equal(a[0], a[1])


def test_uniform_is_uniform():
    u = uniform(draw_key(torch.device("cpu"), seed=1), _step(0), 16, 8192).flatten()
    counts = torch.histc(u, bins=32, min=0, max=1)
    expected = u.numel() / 32
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 70  # 31 degrees of freedom: p ~ 1e-4


def test_gumbel_max_samples_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, float("-inf")])
    key, rows = draw_key(torch.device("cpu"), seed=3), 40000
    picks = (logits + gumbel(key, _step(0), rows, 5)).argmax(-1)
    freq = torch.bincount(picks, minlength=5).double() / rows
    probs = logits.softmax(-1).double()
    assert freq[4] == 0
    assert (freq - probs).abs().max() < 4 * (probs * (1 - probs) / rows).sqrt().max()


def test_chi_square_over_many_keys_has_the_right_tail():
    """Across keys, Gumbel-max sampling of 8 tokens (out of 96 columns) fits chi-square with 7 dof."""
    probs = torch.zeros(96, dtype=torch.float64)
    picked = torch.tensor([15, 18, 29, 41, 55, 63, 69, 88])
    probs[picked] = torch.tensor([0.12, 0.11, 0.11, 0.11, 0.12, 0.18, 0.13, 0.12], dtype=torch.float64)
    scores = probs.float().log()
    rows, keys = 2000, 150
    stats = []
    for seed in range(keys):
        noise = gumbel(draw_key(torch.device("cpu"), seed), _step(0), rows, 96)
        counts = torch.bincount((scores + noise).argmax(-1), minlength=96).double()[picked]
        expected = probs[picked] * rows
        stats.append(((counts - expected) ** 2 / expected).sum().item())
    chi2 = torch.tensor(stats)
    assert 6.0 < chi2.mean() < 8.0
    assert (chi2 > 18.5).float().mean() <= 0.04  # 1% expected above the 0.99 quantile
