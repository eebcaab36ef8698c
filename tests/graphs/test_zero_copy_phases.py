"""Zero-copy inputs across cache-length phases (CPU, null backend), as the `graphs-zero-copy` benchmark runs them.

One callable serves a short cache, then one several times longer (the lane buffers must grow), then a longer
one still; each phase warms up and then repeats the same decode steps. In steady state (every step after the
first of a repetition) nothing may be copied (the tokens, a view `tokens[:, None]`, included), in every phase,
and no prediction may fail; every step equals eager.
"""

import itertools

import pytest
import torch

from benchmarks.cases import graphs_zero_copy as case
from tendril.config import Config
from tendril.graphs.backend import NullBackend
from tendril.graphs.callable import GraphedCallable, graphed
from tendril.graphs.stats import Misprediction

STEPS = 8
LENGTHS = (6, 30, 120)
VOCAB = 11


def toy_step(ids: torch.Tensor, positions: torch.Tensor, *past: torch.Tensor) -> tuple[torch.Tensor, case.Past]:
    """A producer chain shaped like the GPT-2 step: every cache tensor grows by one position, the logits
    depend on all of it (so a wrong or stale input changes the chosen beams)."""
    x = ids.float() * 0.01 + positions.float() * 1e-3
    present = tuple(
        torch.cat([p, (x[:, :, None, None] * (i + 1)).expand(-1, p.shape[1], 1, p.shape[3])], dim=2)
        for i, p in enumerate(past)
    )
    summary = torch.stack([p.mean(dim=(1, 2, 3)) for p in present], dim=1).sum(1, keepdim=True)
    vocab = torch.arange(VOCAB, device=ids.device)
    logits = summary * (vocab / (VOCAB - 1) * 2 - 1) + torch.cos(ids.float() * vocab)
    return logits, present


class ToyConfig:
    n_embd, n_head, n_layer, vocab_size = 8, 2, 2, VOCAB


def decode_phases(fn, auto: GraphedCallable, config, lengths=LENGTHS, reps: int = 2, device="cpu"):
    """The benchmark's loop for `auto` per length: warm-up 2 x STEPS steps, then `reps` repetitions.

    Returns (length, the steady-state bytes copied per step, the mispredictions of the repetitions) per phase,
    after checking every step of every run against eager."""
    report = []
    for length in lengths:
        start = case.prefix(config, length, torch.device(device), torch.float32)
        eager = case.run_loop(lambda s: case.host_step(fn, s), start, STEPS)
        for _ in range(2):
            with auto.zero_copy():
                warm = case.run_loop(lambda s: case.host_step(auto, s), start, STEPS)
            assert_equal(eager, warm)
        mispredicted = dict(auto.stats.mispredictions)
        steady = []
        for _ in range(reps):
            copied: list[int] = []
            with auto.zero_copy():
                states = case.run_loop(lambda s: case.host_step(auto, s), start, STEPS, record_bytes(auto, copied))
            assert_equal(eager, states)
            steady.extend(after - before for before, after in itertools.pairwise(copied))
        new = {
            reason: count - mispredicted.get(reason, 0)
            for reason, count in auto.stats.mispredictions.items()
            if count > mispredicted.get(reason, 0)
        }
        report.append((length, max(steady), new))
    return report


def record_bytes(auto: GraphedCallable, copied: list[int]):
    """A `run_loop` callback recording the bytes `auto` has copied so far after every step."""
    return lambda _: copied.append(auto.stats.input_bytes_copied)


def assert_equal(eager, states) -> None:
    assert case.states_equal(eager, states)
    for a, b in zip(eager, states, strict=True):
        torch.testing.assert_close(a.past, b.past, rtol=0, atol=0)
        torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=0)


def assert_zero_copy_in_every_phase(report) -> None:
    for length, bytes_per_step, mispredictions in report:
        assert bytes_per_step == 0, f"L={length}: {bytes_per_step} bytes copied per steady step"
        assert not mispredictions, f"L={length}: {mispredictions}"


def test_toy_decode_stays_zero_copy_when_the_cache_length_moves_to_larger_ranges():
    auto = graphed(toy_step, backend=NullBackend(), config=Config(), max_graphs=1024)
    with torch.inference_mode():
        report = decode_phases(toy_step, auto, ToyConfig)
    assert_zero_copy_in_every_phase(report)
    # the longer phases outgrew the lane buffers: the redirect that found its buffer too small grew it
    assert auto.stats.mispredictions.get(Misprediction.TOO_LARGE, 0) >= 1


def test_returning_to_a_short_length_after_growth_stays_zero_copy():
    """Graphs of the first phase read lane buffers that have since been reallocated: they are recaptured."""
    auto = graphed(toy_step, backend=NullBackend(), config=Config(), max_graphs=1024)
    with torch.inference_mode():
        report = decode_phases(toy_step, auto, ToyConfig, lengths=(6, 60, 6))
    assert_zero_copy_in_every_phase(report)


def test_gpt2_decode_stays_zero_copy_when_the_cache_length_moves_to_larger_ranges():
    pytest.importorskip("transformers")
    from transformers import GPT2Config

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=97, n_positions=160, bos_token_id=0, eos_token_id=0)
    model = case.gpt2(torch.device("cpu"), torch.float32, config)
    fn = case.forward_step(model)
    auto = graphed(fn, backend=NullBackend(), config=Config(), max_graphs=1024)
    with torch.inference_mode():
        report = decode_phases(fn, auto, config)
    assert_zero_copy_in_every_phase(report)
