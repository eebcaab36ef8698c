"""The CPU-runnable parts of benchmarks/tools/gemv_chain.py: the chain's shapes and the report's markdown."""

from __future__ import annotations

import itertools

from benchmarks.tools.gemv_chain import HEAD, LAYER, chain_shapes, markdown


def test_the_chain_is_llama_layers_then_the_head_each_reading_what_the_one_before_made():
    shapes = chain_shapes(2)
    assert shapes == LAYER * 2 + [HEAD]
    assert all(inp <= before[0] for before, (_, inp) in itertools.pairwise(shapes))


def test_markdown_reports_each_variant_against_the_read_bandwidth():
    report = {"device": "test", "torch": "x", "layers": 1, "weight_bytes": 2.5e9, "read_bandwidth_gb_per_s": 4000.0,
              "sm_count": 132, "variants": [{"variant": "persistent 132", "us_per_chain": 800.0, "gb_per_s": 3125.0,
                                             "bandwidth_fraction": 0.78125, "max_rel_diff": 1e-3}]}
    text = markdown(report)
    assert "2.500 GB of weights; read bandwidth 4000 GB/s; 132 SMs" in text
    assert "| persistent 132 | 800.0 | 3125 | 0.781 | 1.00e-03 |" in text
