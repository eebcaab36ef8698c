"""`beam.bookkeep_and_reorder` through Inductor (`compiled_bookkeep`, what beam search runs with the compiled and
fused steps on CUDA) equals the plain function bit for bit, step after step, on the CPU: eos hits, the length limit,
the scoreboard merge, every early-stopping mode and the cache's row table and `key_valid` rewritten in place, over
two prompt lengths (one compile per set of rules); its top-k orders as the beam top-k does."""

from __future__ import annotations

import warnings

import pytest
import torch

from tendril.generation.beam import _NEG, BeamRules, _largest, _ranked, bookkeep_and_reorder, compiled_bookkeep
from tendril.generation.compile_limit import CompileLimitWarning
from tendril.generation.kernels import reference

B, K, VOCAB, NEW = 2, 3, 7, 6
EOS = torch.tensor([1, 2])
KEEP = max(2, 1 + EOS.numel()) * K


def start_state(prompt_len: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    length = prompt_len + NEW
    sequences = torch.randint(3, VOCAB, (B, K, length), generator=generator)
    scores = torch.zeros(B, K)
    scores[:, 1:] = _NEG
    indices = torch.full((B, K, NEW), -1, dtype=torch.int32)
    return (torch.tensor(prompt_len), sequences, scores, sequences.clone(), torch.full((B, K), _NEG),
            torch.zeros(B, K, dtype=torch.bool), torch.ones(B, 1, dtype=torch.bool), indices, indices.clone(),
            torch.tensor(False))  # fmt: skip


def run(fn, rules: BeamRules, prompt_len: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Every step's state, rows, and the cache's row table and `key_valid` after it."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([prompt_len, NEW])
    constants = (EOS, torch.arange(KEEP) < K, torch.arange(B)[:, None] * K, torch.arange(B * K), lengths)
    length, row_ids = prompt_len + NEW, torch.arange(B * K, dtype=torch.int32)
    table = torch.randint(0, B * K, (B * K, length), generator=generator, dtype=torch.int32)
    key_valid = torch.rand(B * K, length, generator=generator) < 0.8
    cache = (table, key_valid, torch.arange(length), row_ids)
    state, outputs = start_state(prompt_len, generator), []
    for _ in range(NEW):
        log_probs = torch.randn(B, K * VOCAB, generator=generator).log_softmax(-1) + state[2].repeat_interleave(
            VOCAB, 1
        )
        top = torch.topk(log_probs, KEEP)
        state, rows = fn(rules, *cache, top.values, top.indices, *constants, *state)
        outputs.append((*state, rows, table.clone(), key_valid.clone()))
    return outputs


@pytest.mark.parametrize(
    "rules", [BeamRules(VOCAB, 1.0, True), BeamRules(VOCAB, 0.7, "never")], ids=["early", "never-penalty"]
)
def test_compiled_bookkeeping_equals_the_plain_function_bit_for_bit(rules, monkeypatch, tmp_path):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    graphs_before = counters["stats"]["unique_graphs"]
    compiled = compiled_bookkeep()
    for prompt_len, seed in ((4, 0), (9, 1)):
        expected = run(bookkeep_and_reorder, rules, prompt_len, seed)
        got = run(compiled, rules, prompt_len, seed)
        for step, (want, have) in enumerate(zip(expected, got, strict=True)):
            for index, (a, b) in enumerate(zip(want, have, strict=True)):
                assert a.dtype == b.dtype and torch.equal(a, b), (prompt_len, step, index)
    assert counters["stats"]["unique_graphs"] - graphs_before == 1, "not compiled once for both prompt lengths"
    finished_any = any(bool(out[5].any()) for out in expected)
    assert finished_any, "no hypothesis finished: the scoreboard was not exercised"
    torch._dynamo.reset()


def test_rules_past_dynamos_recompile_limit_keep_their_bookkeeping_uncompiled_with_a_warning(monkeypatch, tmp_path):
    """A new set of rules compiles the bookkeeping again; past dynamo's limit (1 here) it runs the plain function, for
    that set from then on, warned once, where the compiled call would raise."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    compiled_bookkeep.cache_clear()
    compiled = compiled_bookkeep()
    first, second = BeamRules(VOCAB, 1.0, True), BeamRules(VOCAB, 0.5, False)
    warned = []
    for rules in (first, second, second):
        with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(recompile_limit=1):
            warnings.simplefilter("always")
            got = run(compiled, rules, 4, 0)
        warned.append(sum(issubclass(w.category, CompileLimitWarning) for w in caught))
        for want, have in zip(run(bookkeep_and_reorder, rules, 4, 0), got, strict=True):
            assert all(torch.equal(a, b) for a, b in zip(want, have, strict=True))
    assert warned == [0, 1, 0] and compiled.plain_keys == {(second, "row table")}
    compiled_bookkeep.cache_clear()
    torch._dynamo.reset()


@pytest.mark.parametrize("seed", range(20))
def test_both_top_k_paths_order_as_the_beam_top_k_with_ties_zeros_and_nan(seed):
    """Bookkeeping's top-k, eager (a stable sort) and as compiled code runs it (the pairwise rank), keeps
    `kernels.beam_top_k`'s order: ties (and -0.0 with +0.0) by the lower index, NaN above every number; rows drawn
    from few values, so that ties are the rule."""
    generator = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 24, (), generator=generator))
    k = int(torch.randint(1, n + 1, (), generator=generator))
    scores = torch.randint(-3, 4, (3, n), generator=generator).float()
    scores[torch.rand(3, n, generator=generator) < 0.15] = float("nan")
    scores[torch.rand(3, n, generator=generator) < 0.15] = -0.0
    scores[0, : n // 2] = _NEG  # the scoreboard's empty entries, all equal
    expected = reference.beam_top_k(scores, k)[1]
    assert torch.equal(_largest(scores, k), expected)
    assert torch.equal(_ranked(scores, k), expected)
