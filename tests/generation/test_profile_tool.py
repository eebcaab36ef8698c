"""The CPU-runnable parts of benchmarks/tools/profile_generation.py: variant names and the report's markdown."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tools.profile_generation import INDUCTOR_OPTIONS, markdown, parse_variant


def test_variants_name_a_step_and_inductor_options():
    assert parse_variant("fused") == ("fused", {})
    assert parse_variant("compiled-cdt") == ("compiled", INDUCTOR_OPTIONS["cdt"])
    for bad in ("inductor", "fused-cdt", "compiled-fast"):
        with pytest.raises(ValueError, match="expected one of eager, compiled, fused"):
            parse_variant(bad)


def test_markdown_reports_variants_failures_and_sweep():
    kernel = {"name": "triton_|fused", "per_step": 2.0, "mean_us": 1.5, "total_us": 3.0}
    report = {
        "device": "test", "torch": torch.__version__, "new_tokens": 8, "prompt_len": 4,
        "variants": [
            {"variant": "fused", "tok_per_s": 1000.0, "ms_per_token": 1.0, "warmup_s": 0.5, "matches_hf": True,
             "first_token_ms": 2.5, "loop_ms_per_step": 0.95, "other_ms": 0.85, "step_graph_ms": 0.9,
             "loop_operations_per_call": 12.0,
             "outside_loop_kernels": [{"name": "gemm", "per_call": 3.0, "mean_us": 2.0, "total_us": 6.0}],
             "step": {"operations": 5.0, "busy_us": 3.0, "gap_us": 1.0, "kernels": [kernel]}},
            {"variant": "compiled", "error": "RuntimeError: boom"},
        ],
        "sweep": [{"shape": "ln_1+c_attn", "bytes_per_launch": 9e6, "cublas_us": 5.0,
                   "best": {"us": 4.0, "block_n": 16, "block_k": 256, "split_k": 3, "warps": 4},
                   "configs": [{"us": 4.5, "default": True}]}],
    }
    text = markdown(report)
    assert "| fused | 1000 | 1.0000 | 0.50 | yes | 2.500 | 0.9500 | 0.850 | 0.9000 | 5.0 | 3.0 | 1.0 | 12 |" in text
    assert "| `gemm` | 3.00 | 2.00 | 6.00 |" in text
    assert "| compiled | failed: RuntimeError: boom |" in text
    assert "`triton_\\|fused`" in text
    assert "| ln_1+c_attn | 9.00 | 5.00 | 4.50 | 2000 | 4.00 | 2250 | n=16 k=256 split=3 warps=4 |" in text


def test_markdown_titles_name_the_model_and_the_search():
    report = {"device": "test", "torch": torch.__version__, "new_tokens": 8, "prompt_len": 4, "variants": []}
    assert markdown(report).startswith("# Profile of the greedy decode step (GPT-2 124M fp16, batch 1)")
    sweep = [{"shape": "norm+qkv", "rows": 4, "cublas_us": 5.0, "best": None, "configs": []}]
    text = markdown({**report, "model": "llama1b", "beams": 4, "sweep": sweep})
    assert text.startswith("# Profile of the 4-beam decode step (Llama-3.2-1B's shape, bf16, batch 1)")
    assert "| norm+qkv (4 rows) | nan | 5.00 | nan | nan | nan | nan |" in text
    assert "| variant |" not in text  # a sweep-only run has no variant table
