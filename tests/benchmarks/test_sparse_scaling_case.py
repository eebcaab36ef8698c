"""The `sparse-scaling` case's pieces that need no GPU: registration, the per-layer table, the markdown with the
case's own tables, and its plot on synthetic results."""

import pytest

from benchmarks import plots, registry, results
from benchmarks.cases import sparse_scaling

LAYER = {
    "layer": "features.0",
    "kind": "conv",
    "weight_density": 0.1,
    "activation_density": 1.0,
    "kernel_default": "dense",
    "kernel_sparse_only": "triton",
    "kernel_ms": {"triton": 0.02, "dense": 0.01},
    "compress_ms": 0.005,
    "best_sparse_ms": 0.02,
    "best_dense_fp16_ms": 0.01,
}


def _result() -> dict:
    rows = []
    for network in ("alexnet", "vgg16"):
        for density in sparse_scaling.DENSITIES:
            for index, variant in enumerate(plots.SCALING_VARIANTS):
                ms = 1.0 + index * density
                rows.append({"variant": f"{network}_d{density:g} {variant}", "metric": "ms_per_call", "median": ms,
                             "p10": ms, "p90": ms, "n": 5})  # fmt: skip
    table = sparse_scaling._layer_table([LAYER, {**LAYER, "kind": "linear"}])
    return {
        "case": "sparse-scaling",
        "command": "python -m benchmarks run sparse-scaling",
        "device": "test",
        "driver": "-",
        "torch": "-",
        "date": "-",
        "rows": rows,
        "targets": {"max_rel_error_fp16": 0.001},
        "goals": {},
        "notes": [],
        "extra": {"markdown_tables": {"alexnet_d0.1: sparse kernels against dense fp16": table}},
    }


def test_the_case_is_registered():
    assert "sparse-scaling" in registry.discover()


def test_the_markdown_holds_the_per_layer_table():
    md = results.markdown(_result())
    assert "## alexnet_d0.1: sparse kernels against dense fp16" in md
    assert "| features.0 | 0.100 | 1.000 | triton | 0.0200 | 0.0050 | 0.0100 | 2.00 |" in md
    assert md.count("| features.0 |") == 1  # FC layers are not in the convolution table


def test_the_plot_draws_time_against_density(tmp_path):
    pytest.importorskip("matplotlib")
    png = plots.write_plot(_result(), tmp_path / "sparse-scaling.png")
    assert png is not None and png.read_bytes().startswith(b"\x89PNG")
