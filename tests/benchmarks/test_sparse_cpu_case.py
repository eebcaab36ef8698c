"""The `sparse-cpu` case: the host description it records, and a quick run of one model end to end."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.cases import sparse_cpu as case
from benchmarks.registry import Context

pytest.importorskip("numba")

HYPERTHREADED = "\n\n".join(
    f"processor\t: {cpu}\nmodel name\t: Some CPU\nphysical id\t: 0\ncore id\t\t: {cpu % 2}" for cpu in range(4)
)


def test_host_cpus_counts_distinct_physical_cores():
    assert case.host_cpus(HYPERTHREADED) == {"logical": os.cpu_count(), "physical_cores": 2, "model": "Some CPU"}
    assert case.host_cpus("")["physical_cores"] is None


def test_a_quick_run_reports_the_targets_and_dense_scaling(monkeypatch):
    monkeypatch.setenv("SPARSE_CPU_MODELS", "alexnet")
    monkeypatch.setenv("SPARSE_CPU_DENSITIES", "0.1")
    ctx = Context(device=torch.device("cpu"), quick=True)
    case.run(ctx)
    assert ctx.targets["alexnet_d0.1_cpu_speedup_vs_dense_1thread"] > 0
    if (os.cpu_count() or 1) > 1:
        assert ctx.targets["alexnet_d0.1_dense_thread_scaling"] > 0
        rows = {(r.variant, r.metric): r.median for r in ctx.rows}
        ceiling = rows[("alexnet_d0.1 host", "thread_scaling_ceiling")]
        assert ceiling > 0 and len(ctx.extra["alexnet_d0.1"]["host_clock"]) == 2
        scaling = ctx.targets["alexnet_d0.1_cpu_thread_scaling"]
        assert rows[("alexnet_d0.1 tendril cpu", "thread_scaling_over_ceiling")] == pytest.approx(scaling / ceiling)
    assert ctx.extra["host_cpus"]["logical"] == os.cpu_count()
    steps = ctx.extra["alexnet_d0.1"]["forward_steps_ms"]
    assert "1 thread" in steps and all(ms >= 0 for ms in steps["1 thread"].values())
    assert any("features" in name for name in steps["1 thread"])  # the pools' steps are timed too
    other = [r for r in ctx.rows if r.metric == "other_steps_ms_in_forward"]
    assert other and all(r.median > 0 for r in other)
