"""The CPU-runnable parts of `profile_generation --sweep` (`linear_sweep.py`): which launches it tries per projection,
and how its report names a projection swept with weights in another layout than its model's."""

from __future__ import annotations

import pytest
import triton

from benchmarks.tools import linear_sweep as tool
from benchmarks.tools import profile_generation
from tendril.generation.kernels import launch


@pytest.mark.parametrize("shape", tool.SWEEP_SHAPES["llama1b"] + tool.SWEEP_SHAPES["gpt2"], ids=lambda s: s[0])
@pytest.mark.parametrize("layout", ["model", "linear"])
def test_one_row_sweeps_try_the_default_first_and_every_deep_launch_on_contiguous_weights(shape, layout):
    _, out_f, in_f, weight_layout, norm_kind, *_ = shape
    k_contiguous = (weight_layout if layout == "model" else layout) == "linear"
    segments = 2 if len(shape) > 7 and shape[7] else 1
    configs = tool.sweep_configs(out_f, in_f, k_contiguous, rows=1, size=0, normed=norm_kind is not None,
                                 segments=segments, sm_count=132)
    default = launch.launch_config(segments * out_f, in_f, 1, k_contiguous=k_contiguous, normed=norm_kind is not None,
                                   matrices=segments, sm_count=132)
    assert configs[0] == (default.block_n, default.block_k, default.split_k, default.num_warps, default.dot)
    if not k_contiguous:  # Conv1D weights: no deep tiles (and no draws from the pool at size 0)
        assert configs == configs[:1]
        return
    deep = configs[1:]
    assert deep == [c for c in tool.deep_configs(in_f, segments) if c != configs[0]]
    assert {c[3] for c in deep} == {4, 8} and {c[1] for c in deep} == {triton.next_power_of_2(in_f) // d
                                                                        for d in (1, 2)}
    for config in deep:
        held = launch.one_row_held(config[0], config[1], in_f, segments, config[2])
        assert config[2] == 1 and 4096 <= held <= launch.ONE_ROW_TILE * config[3] // 4
    assert len(tool.sweep_configs(out_f, in_f, True, rows=1, size=4, segments=segments, sm_count=132)) == (
        len(configs) + 4)  # the drawn ones come after, none repeated


@pytest.mark.parametrize("rows", [2, 4])
def test_beam_sweeps_on_contiguous_weights_try_deep_cuda_core_launches_within_the_register_budget(rows):
    """Beams (a few rows) on nn.Linear weights: after both paths' defaults, the deep CUDA-core launches whose broadcast
    products (one per row of the program) fit the one-row budget; none on Conv1D weights."""
    configs = tool.sweep_configs(2304, 768, True, rows=rows, size=0, normed=True, sm_count=132)
    assert not configs[0][4] and configs[1][4]  # a small projection: deep CUDA-core tiles, then tensor cores
    large = tool.sweep_configs(3072, 2048, True, rows=rows, size=0, normed=True, sm_count=132)
    assert large[0][4] and not large[1][4]  # Llama-1B's QKV: tensor cores, then the CUDA-core path's default
    deep = configs[2:]
    assert deep and deep == [c for c in tool.deep_configs(768, 1, rows) if c not in configs[:2]]
    for block_n, block_k, split_k, warps, dot in deep:
        held = rows * launch.one_row_held(block_n, block_k, 768)
        assert not dot and split_k == 1 and 4096 <= held <= launch.ONE_ROW_TILE * warps // 4
    assert set(tool.deep_configs(768, 1, 1)) - set(tool.deep_configs(768, 1, 4))  # one row's widest are too wide
    assert len(tool.sweep_configs(2304, 768, False, rows=rows, size=0, normed=True, sm_count=132)) == 2  # Conv1D


def test_a_projection_swept_in_another_layout_says_so():
    entry = {"shape": "ln_1+c_attn", "layout": "linear", "rows": 1, "bytes_per_launch": 3.5e6, "cublas_us": 4.0,
             "configs": [{"default": True, "us": 3.0}],
             "best": {"us": 2.5, "block_n": 4, "block_k": 1024, "split_k": 1, "warps": 4, "dot": False}}
    report = {"device": "d", "torch": "t", "model": "gpt2", "new_tokens": 1, "prompt_len": 1, "variants": [],
              "sweep": [entry, {**entry, "shape": "ln_f+lm_head"}]}
    text = profile_generation.markdown(report)
    assert "| ln_1+c_attn, weights K-contiguous | 3.50 |" in text
    assert "| ln_f+lm_head | 3.50 |" in text  # nn.Linear in the model already


def test_a_grid_sweep_tries_the_defaults_then_every_tensor_core_launch_of_the_grid_once():
    configs = tool.sweep_configs(8192, 2048, True, rows=16, normed=True, segments=2, sm_count=132, grid=True)
    default = launch.launch_config(2 * 8192, 2048, 16, k_contiguous=True, normed=True, matrices=2, sm_count=132)
    assert configs[0] == (default.block_n, default.block_k, default.split_k, default.num_warps, default.dot)
    assert not configs[1][4]  # the CUDA-core path's default, then the grid
    grid = tool.tensor_core_grid(2048, segments=2)
    assert configs[2:] == [c for c in grid if c not in configs[:2]] and len(set(configs)) == len(configs)
    assert all(c[4] and 1024 <= c[0] * c[1] * 2 <= 8192 for c in grid)
    assert {c[2] for c in grid} == {1, 2, 4, 8} and {c[3] for c in grid} == {4, 8}
    assert max(c[2] for c in tool.tensor_core_grid(64)) == 2  # no more shares than tiles (64 / 32)
    assert tool.sweep_configs(8192, 2048, True, rows=1, size=0, grid=True, sm_count=132) == tool.sweep_configs(
        8192, 2048, True, rows=1, size=0, sm_count=132)  # one row: no tensor cores, the grid is not used


def test_a_sweep_refuses_projection_labels_the_model_lacks():
    with pytest.raises(ValueError, match="no llama1b projection labelled c_fc; expected some of norm\\+qkv"):
        tool.sweep_linear("llama1b", rows=16, shapes=["norm+qkv", "c_fc"])
