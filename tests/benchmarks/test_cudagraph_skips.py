"""`benchmarks.cudagraph_skips.watch` counts the CUDA-graph skips torch.compile makes inside its block (on the CPU,
reduce-overhead skips every graph: there is no CUDA graph to record)."""

from __future__ import annotations

import torch

from benchmarks import cudagraph_skips


def test_a_reduce_overhead_compile_on_the_cpu_is_reported_as_skipped(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    layer = torch.compile(torch.nn.Linear(4, 4), mode="reduce-overhead")
    with cudagraph_skips.watch() as report:
        layer(torch.randn(2, 4))
    torch._dynamo.reset()
    assert report["skips"] >= 1


def test_nothing_compiled_means_no_skip():
    with cudagraph_skips.watch() as report:
        torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert report == {"skips": 0, "reasons": []}
