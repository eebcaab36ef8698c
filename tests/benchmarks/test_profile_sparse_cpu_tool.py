"""The `profile_sparse_cpu` tool: a quick run writes every part with positive times (no speed-up is asserted: CI
machines have two cores shared with other jobs), and its count of parallel regions per kernel call."""

import json

import numpy as np
import pytest

pytest.importorskip("numba")


def test_a_quick_run_reports_regions_layers_and_forwards(tmp_path):
    from benchmarks.tools import profile_sparse_cpu as tool

    report = tool.main(["--out", str(tmp_path), "--quick"])
    assert json.loads((tmp_path / "profile_sparse_cpu.json").read_text()) == json.loads(json.dumps(report))
    threads = report["threads"]
    assert threads[0] == 1 and set(threads) <= {1, 2}
    assert report["numba_threading_layer"] and report["host"]["logical"]
    for n in map(str, threads):
        region = report["empty_region"][n]
        assert region["serial_call_us"]["median"] > 0
        assert all(region["region_us"][str(gap)]["median"] > 0 for gap in tool.GAPS_US)

        forward = report["forward"][n]
        assert forward["ms"]["median"] > 0 and forward["traced_ms"] > 0 and forward["kernel_ms"] > 0
        assert forward["glue_ms"] >= 0 and forward["gap_us"]["median"] > 0 and forward["glue_alone_ms"]["median"] > 0
        assert forward["regions"] is None and forward["wake_estimate"] is None  # not counted under --quick
        assert sum(k["calls"] for k in forward["by_kernel"].values()) == forward["kernel_calls"] > 0
        traced_steps = {s["step"] for s in forward["steps"]}
        for layer in report["layers"]:
            assert layer["layer"] in traced_steps
            per = layer["threads"][n]
            assert per["kernels"] and all(k["us"]["median"] > 0 for k in per["kernels"])
            assert per["call_us"]["median"] > 0 and per["call_torch_at_threads_us"]["median"] > 0
    roles = [role for layer in report["layers"] for role in layer["roles"]]
    assert len(roles) == 7 and "the first strided 1×1" in roles and report["layers"][-1]["shape"].startswith("FC")

    markdown = (tmp_path / "profile_sparse_cpu.md").read_text()
    assert "## Whole forward" in markdown and all(f"`{layer['layer']}`" in markdown for layer in report["layers"])


def test_regions_per_call_counts_the_parallel_loops_a_kernel_launched_with():
    from benchmarks.tools import profile_sparse_cpu as tool

    tool.empty_region(np.zeros(8, dtype=np.float32))
    assert tool.regions_per_call(tool.empty_region) == 1


def test_the_trace_covers_the_serial_kernels_and_leaves_the_inlined_helpers_out():
    from benchmarks.tools import profile_sparse_cpu as tool
    from tendril.sparse.ops import cpu_threads

    kernels = tool.compiled_kernels(cpu_threads.kernels())
    assert {"conv_direct", "count_channels", "sum_band_counts"} <= kernels.keys()
    assert not {"write_band", "_products", "_at"} & kernels.keys()
    tool.serial_call(np.zeros(1, dtype=np.float32))
    assert tool.regions_per_call(tool.serial_call) == 0


def test_thread_counts_must_be_positive_integers():
    from benchmarks.tools import profile_sparse_cpu as tool

    assert tool._thread_counts("4,1,2,1") == [1, 2, 4]
    for bad in ("0,1", "one", ""):
        with pytest.raises(ValueError, match="--threads"):
            tool._thread_counts(bad)


def test_the_forward_summary_counts_regions_and_prices_their_wake_ups():
    from benchmarks.tools import profile_sparse_cpu as tool

    trace = tool.KernelTrace()
    trace.calls = [tool.KernelCall("a", "s1", 0.0, 1e-3, None), tool.KernelCall("b", "s2", 1.02e-3, 1.52e-3, None)]
    trace.steps = [("s1", 0.0, 1.01e-3), ("s2", 1.01e-3, 1.6e-3)]
    forward = {"ms": {"median": 2.0}, "traces": [(trace, 2e-3), (trace, 2e-3)]}
    tool.summarize_traces(forward, {"a": 1, "b": 2})
    assert forward["kernel_calls"] == 2 and forward["regions"] == 3
    assert forward["kernel_ms"] == pytest.approx(1.5) and forward["glue_ms"] == pytest.approx(0.5)
    assert forward["gap_us"]["median"] == pytest.approx(20.0)
    assert [s["kernels"][0]["us"] for s in forward["steps"]] == pytest.approx([1000.0, 500.0])
    region = {"wake_us": {"0": 1.0, "20": 5.0, "200": 9.0, "2000": 20.0}}
    assert tool.wake_estimate(forward, region) == {"gap_us": 20, "wake_us": 5.0, "ms": 0.015}
