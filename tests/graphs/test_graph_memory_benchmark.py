"""The CPU-independent parts of the `graphs-memory` benchmark case: length spreads, linear extrapolation of
the separate-pools memory, overhead ratios, per-extra-graph memory."""

from __future__ import annotations

import pytest

from benchmarks import registry
from benchmarks.cases import graphs_memory as case


def test_the_case_is_registered_and_needs_a_gpu():
    assert registry.CASES["graphs-memory"].needs_gpu


def test_spread_covers_both_ends_without_repeats():
    lengths = case.spread(1, 1024, 48)
    assert lengths[0] == 1 and lengths[-1] == 1024 and len(lengths) == 48 == len(set(lengths))
    assert case.spread(16_000, 256_000, 64)[-1] == 256_000
    assert case.spread(5, 7, 10) == [5, 6, 7]
    with pytest.raises(ValueError):
        case.spread(3, 1, 2)


def test_linear_extrapolation_recovers_a_line_and_counts_what_it_guessed():
    lengths = list(range(1, 101))
    line = {n: 3_000_000 + 200_000 * n for n in lengths}
    measured = {n: b for n, b in line.items() if n <= 40}
    total, guessed = case.extrapolate_linear(measured, lengths)
    assert guessed == 60
    assert total == pytest.approx(sum(line.values()), rel=1e-9)
    assert case.extrapolate_linear(line, lengths) == (float(sum(line.values())), 0)
    with pytest.raises(ValueError, match="at least 4"):
        case.extrapolate_linear({1: 5, 2: 6}, lengths)


def test_extrapolation_ignores_the_noisy_first_half_and_never_goes_negative():
    lengths = list(range(1, 21))
    measured = {1: 50_000_000, 2: 0, 3: 1_000, 4: 2_000, 5: 3_000, 6: 4_000}  # first graph paid for a chunk
    total, guessed = case.extrapolate_linear(measured, lengths)
    assert guessed == 14
    assert total == pytest.approx(sum(measured.values()) + sum(1_000 * (n - 2) for n in range(7, 21)))
    falling = {1: 400, 2: 300, 3: 200, 4: 100}
    total, _ = case.extrapolate_linear(falling, list(range(1, 10)))
    assert total == pytest.approx(1_000)


def test_overhead_and_per_extra_graph():
    assert case.overhead([[1.0, 1.0], [3.0, 3.0], [2.2, 2.2]], [[1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]) == 1.1
    assert case.per_extra_graph(10, 110, 11) == 10.0
    assert case.per_extra_graph(10, 10, 1) == 0.0


def test_switching_totals_include_the_prefetch_counters():
    from types import SimpleNamespace

    from tendril.graphs.stats import GraphMemory

    memories = [
        GraphMemory(instantiations=2, prefetches=1, prefetch_hits=1, switch_ms=0.5),
        GraphMemory(instantiations=1, prefetches=1, prefetch_wasted=1, prefetch_waits=0, evictions=1),
    ]
    fake = SimpleNamespace(stats=SimpleNamespace(graphs={i: SimpleNamespace(memory=m) for i, m in enumerate(memories)}))
    totals = case._switching(fake)  # type: ignore[arg-type]
    assert set(case.PREFETCH_STATS) <= set(totals)
    assert totals["prefetches"] == 2 and totals["prefetch_hits"] == 1 and totals["prefetch_wasted"] == 1
    assert totals["instantiations"] == 3 and totals["switch_ms"] == 0.5


def test_length_bands_halve_from_the_longest_and_cover_every_length():
    assert case.length_bands(list(range(1, 1025))) == [(1, 64), (65, 128), (129, 256), (257, 512), (513, 1024)]
    assert case.length_bands(list(range(1, 49))) == [(1, 3), (4, 6), (7, 12), (13, 24), (25, 48)]
    audio = case.spread(16_000, 256_000, 64)
    bands = case.length_bands(audio)
    assert bands[0] == (16_000, 16_000) and bands[-1] == (128_001, 256_000)
    assert all(sum(low <= n <= high for low, high in bands) == 1 for n in audio)
    assert case.length_bands([100, 101], count=3) == [(100, 101)]  # the bands below the shortest are empty


def test_overhead_by_band_sums_each_bands_lengths():
    order = [3, 1, 2, 4]
    candidate = case.per_length_median([[6.0, 1.0, 2.0, 8.0], [9.0, 3.0, 2.0, 8.0], [6.0, 2.0, 2.0, 4.0]], order)
    assert candidate == {3: 6.0, 1: 2.0, 2: 2.0, 4: 8.0}
    reference = {1: 1.0, 2: 1.0, 3: 4.0, 4: 4.0}
    assert case.overhead_by_band(candidate, reference, [(1, 2), (3, 4)]) == {"1-2": 2.0, "3-4": 1.75}
    assert case.overhead_by_band(candidate, reference, [(5, 9)]) == {}


def test_options_of_c_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("GRAPHS_MEMORY_STRATEGY", raising=False)
    monkeypatch.delenv("GRAPHS_MEMORY_PREFETCH", raising=False)
    assert case._options() == {"strategy": "auto"}
    monkeypatch.setenv("GRAPHS_MEMORY_STRATEGY", "update")
    monkeypatch.setenv("GRAPHS_MEMORY_PREFETCH", "off")
    assert case._options() == {"strategy": "update", "prefetch": False}
    monkeypatch.setenv("GRAPHS_MEMORY_PREFETCH", "fresh")
    with pytest.raises(ValueError, match="GRAPHS_MEMORY_PREFETCH"):
        case._options()
