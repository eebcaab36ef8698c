"""The CPU-independent parts of the `graphs-vs-compile` benchmark case: the drawn lengths and call order, the sizes,
the ratio; the target names are a contract."""

from __future__ import annotations

import inspect

import pytest

from benchmarks import registry
from benchmarks.cases import graphs_vs_compile as case


def test_the_case_is_registered_needs_a_gpu_and_reports_the_issues_targets():
    assert registry.CASES["graphs-vs-compile"].needs_gpu
    source = inspect.getsource(case)
    for name in ("compiled_graphed_over_compile_per_call", "graphed_warmup_over_compile_warmup",
                 "compiled_graphed_warm_start_s", "compiled_graphed_memory_over_compile"):  # fmt: skip
        assert f'"{name}"' in source


def test_46_distinct_lengths_in_1_to_256_over_144_calls_each_used():
    count, top, calls = case.sizes(quick=False)
    lengths, order = case.draw_lengths(count, top, calls)
    assert (len(lengths), len(set(lengths)), len(order)) == (46, 46, 144)
    assert min(lengths) >= 1 and max(lengths) <= 256 and set(order) == set(lengths)
    assert case.draw_lengths(count, top, calls) == (lengths, order), "the second process must draw the same lengths"
    assert order != sorted(order)


def test_quick_is_small_and_bad_sizes_are_refused():
    count, _, calls = case.sizes(quick=True)
    assert count <= 8 and calls <= 24
    with pytest.raises(ValueError, match="cannot draw"):
        case.draw_lengths(10, 5, 20)
    assert case.ratio(1.0, 2.0) == 0.5 and case.ratio(1.0, 0.0) == float("inf")


def test_capture_phases_are_summed_over_the_graphs():
    from types import SimpleNamespace

    from benchmarks.cases.graphs_vs_compile import capture_phases_ms

    records = [SimpleNamespace(phases_ms={"warmup": 1.0, "record": 2.0}), SimpleNamespace(phases_ms={"warmup": 3.0})]
    stats = SimpleNamespace(graphs={index: record for index, record in enumerate(records)})
    assert capture_phases_ms(stats) == {"warmup": 4.0, "record": 2.0}


def test_memory_is_split_into_pool_placeholders_and_driver():
    from tendril.graphs.stats import GraphStats

    stats = GraphStats()
    stats.pool_bytes, stats.placeholder_bytes = 3 * 2**20, 2**19
    assert case.memory_mib(stats) == {"pool": 3.0, "placeholders": 0.5, "driver": 0.0}


def test_pool_segments_leave_out_the_allocators_own_pool_largest_first():
    mib = 2**20
    snapshot = [
        {"segment_pool_id": (0, 0), "total_size": 64 * mib, "allocated_size": 64 * mib},
        {"segment_pool_id": (0, 3), "total_size": 20 * mib, "allocated_size": 0},
        {"segment_pool_id": (0, 3), "total_size": 26 * mib, "allocated_size": 25 * mib},
        {"segment_pool_id": (5, 0), "total_size": 2 * mib, "allocated_size": mib},
    ]
    assert case.pool_segments_mib(snapshot) == [(26.0, 25.0), (20.0, 0.0), (2.0, 1.0)]


def test_second_processes_share_the_tendril_cache_and_a_bytecode_cache_under_it(monkeypatch, tmp_path):
    """The warm start's processes get the first process's cache dir and Python's bytecode cache inside it (which a
    first one, left out of the median, writes), and the last line they print is their report."""
    import subprocess
    from types import SimpleNamespace

    seen = {}

    def run(command, env, **kwargs):
        seen.update(command=command, env=env)
        return SimpleNamespace(returncode=0, stdout='noise\n{"ready_s": 1.5}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert case._warm_start(tmp_path, quick=True) == {"ready_s": 1.5}
    env = seen["env"]
    assert env["TENDRIL_CACHE_DIR"] == str(tmp_path) and env["PYTHONPYCACHEPREFIX"] == str(tmp_path / "pycache")
    assert "TORCHINDUCTOR_CACHE_DIR" not in env and "PYTHONDONTWRITEBYTECODE" not in env
    assert seen["command"][-2:] == ["warm-start", "--quick"]
