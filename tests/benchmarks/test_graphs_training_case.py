"""The CPU-independent parts of the `graphs-training` benchmark case: bucket sizes, model choice, drawn lengths,
the correctness run's lengths; the target names are a contract."""

from __future__ import annotations

import inspect

import pytest
import torch

from benchmarks import registry
from benchmarks.cases import graphs_training as case


def test_the_case_is_registered_needs_a_gpu_and_reports_the_issues_targets():
    assert registry.CASES["graphs-training"].needs_gpu
    source = inspect.getsource(case)
    for name in ("_step_over_kernel_time", "_speedup_vs_eager", "_speedup_vs_compile",
                 "wav2vec2_memory_ratio_vs_separate_pools", "max_param_rel_diff_amp_20_steps"):  # fmt: skip
        assert name in source


def test_bucket_sizes_cover_1_to_4_seconds_by_a_quarter_second():
    sizes = case.bucket_sizes(16_000, 64_000, 4_000)
    assert sizes[0] == 16_000 and sizes[-1] == 64_000 and len(sizes) == 13
    assert case.bucket_sizes(32, 512, 32)[-1] == 512
    with pytest.raises(ValueError, match="cannot bucket"):
        case.bucket_sizes(32, 500, 32)


def test_models_are_chosen_by_the_environment_variable():
    assert case.chosen_models(None) == ("wav2vec2", "gpt2")
    assert case.chosen_models("gpt2") == ("gpt2",)
    assert case.chosen_models(" gpt2 , wav2vec2") == ("wav2vec2", "gpt2")
    with pytest.raises(ValueError, match="GRAPHS_TRAINING_MODELS"):
        case.chosen_models("bert")


def test_drawn_lengths_fall_in_the_buckets_and_correctness_lengths_reuse_two():
    sizes = case.bucket_sizes(32, 512, 32)
    lengths = case.draw_lengths(sizes, 500, torch.Generator().manual_seed(0))
    assert min(lengths) >= 32 and max(lengths) <= 512 and len(set(lengths)) > 100
    run = case.correctness_lengths(sizes, 20)
    assert len(run) == 20 and {(n + 31) // 32 * 32 for n in run} == {480, 512}
    assert case.ratio(3.0, 2.0) == 1.5 and case.ratio(1.0, 0.0) == float("inf")


def test_deterministic_algorithms_are_on_inside_and_restored_after(monkeypatch):
    monkeypatch.delenv(case.CUBLAS_WORKSPACE, raising=False)
    found: list[str] = []
    with case.deterministic_algorithms(found):
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert case.os.environ[case.CUBLAS_WORKSPACE] == ":4096:8"
        case.warnings.warn("an op without a deterministic algorithm\nits details")
    assert found == ["an op without a deterministic algorithm"]
    assert not torch.are_deterministic_algorithms_enabled() and case.CUBLAS_WORKSPACE not in case.os.environ
