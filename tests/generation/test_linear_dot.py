"""The linear kernel's launches: `launch_config`'s choice between CUDA cores and tensor cores, the arguments that
force one, its deep one-row tiles, and the launches of Llama-3.2-1B's one-row and GPT-2's and Llama-3.2-1B's 4-beam
steps compiled for sm_90 (the interpreter checks their numbers: interpreted_kernels.py; the GPU too:
test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import triton

from tendril.generation.kernels import launch, layers, linear
from tendril.generation.kernels.layers import SPLIT_K_LOCKS, Norm, Projection

GPT2 = [(2304, 768, False), (768, 768, False), (3072, 768, False), (768, 3072, False), (50257, 768, True)]
LLAMA_1B = [(3072, 2048, True), (2048, 2048, True), (16384, 2048, True), (2048, 8192, True), (128256, 2048, True)]
"""(columns, in_features, k_contiguous) of each model's projections (Conv1D's columns are contiguous)."""


@pytest.mark.parametrize("columns, in_features, k_contiguous", GPT2 + LLAMA_1B)
def test_several_half_rows_take_tensor_cores_with_one_launch_for_up_to_16_rows(columns, in_features, k_contiguous):
    one = launch.launch_config(columns, in_features, 1, k_contiguous=k_contiguous)
    assert not one.dot and one.block_m == 1
    for normed, tile, depth in ((True, launch.DOT_TILE, launch.DOT_TILE_K),
                                (False, launch.PLAIN_DOT_TILE, launch.PLAIN_DOT_TILE_K)):
        beams = [launch.launch_config(columns, in_features, rows, k_contiguous=k_contiguous, normed=normed)
                 for rows in (2, 4, 16)]
        assert len(set(beams)) == 1  # the rows share every weight tile: the launch does not depend on them
        dot = beams[0]
        assert dot.dot and dot.block_m == launch.DOT_ROWS
        assert dot.block_n * dot.block_k <= tile * (2 if k_contiguous and normed else 1) and dot.block_k <= depth
        assert triton.next_power_of_2(dot.split_k) * dot.block_m * dot.block_n <= launch.DOT_PARTIALS
    fma = launch.launch_config(columns, in_features, 4, k_contiguous=k_contiguous, dot=False)
    assert not fma.dot and fma.block_m == 4 and fma.block_n * fma.block_k <= launch.TILE_BYTES // 2 // 4  # per row
    wide = launch.launch_config(columns, in_features, 4, k_contiguous=k_contiguous, element_size=4, half_inputs=False)
    assert not wide.dot and wide.block_m == 4  # float32 products stay on CUDA cores (tl.dot would round to TF32)


@pytest.mark.parametrize("columns, in_features, k_contiguous", [shape for shape in GPT2 if not shape[2]])
def test_conv1d_tensor_core_launches_split_k_to_half_the_sms_and_fit_one_wave_of_8_warp_programs(columns, in_features,
                                                                                                  k_contiguous):
    sm_count = 132
    for normed in (False, True):
        config = launch.launch_config(columns, in_features, 4, k_contiguous=k_contiguous, normed=normed)
        column_blocks = -(-columns // config.block_n)
        programs = column_blocks * config.split_k
        k_tiles = -(-in_features // config.block_k)
        prefetched = -(-k_tiles // launch.PREFETCHED_TILES)  # the split that leaves no tile unprefetched
        if column_blocks <= SPLIT_K_LOCKS and config.split_k > prefetched:  # split further only to fill half the SMs
            assert column_blocks * prefetched < sm_count // launch.DOT_FILL, config
        tile = config.block_n * config.block_k
        one_wave = programs * tile <= sm_count * launch.DOT_WAVE_TILE
        if not one_wave and column_blocks <= SPLIT_K_LOCKS:  # no split that fits one wave still fills half the SMs
            fitting = sm_count * launch.DOT_WAVE_TILE // tile // column_blocks
            assert column_blocks * fitting < sm_count // launch.DOT_FILL, config
        assert config.num_warps == (launch.DOT_WIDE_WARPS if one_wave else 4), config
    plain = launch.launch_config(768, 768, 4, k_contiguous=False)
    normed = launch.launch_config(768, 768, 4, k_contiguous=False, normed=True)
    assert (plain.block_n, plain.block_k, normed.block_n, normed.block_k) == (32, 256, 32, 128)


@pytest.mark.parametrize("columns, in_features", [(c, i) for c, i, k_contiguous in GPT2 + LLAMA_1B if k_contiguous]
                         + [(8, 40), (200, 5000), (4096, 14336)])
@pytest.mark.parametrize("matrices", [1, 2])
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("rows", [2, 16, 40])
def test_linear_tensor_core_launches_split_k_in_powers_of_two_to_fill_the_sms_with_short_shares(
        columns, in_features, matrices, normed, rows):
    config = launch.launch_config(matrices * columns, in_features, rows, k_contiguous=True, normed=normed,
                                  matrices=matrices, dot=True)  # small launches of up to 4 rows take deep tiles
    assert config.dot and config.block_m == launch.DOT_ROWS
    assert config.block_k == max(min(triton.next_power_of_2(in_features), launch.DOT_TILE // launch.DOT_COLUMNS
                                     // matrices), launch.DOT_MIN)
    row_groups = -(-rows // launch.DOT_ROWS)
    if -(-columns // launch.DOT_COLUMNS) * row_groups > SPLIT_K_LOCKS:  # an LM head: small programs, unsplit
        assert (config.block_n, config.num_warps, config.split_k) == (launch.DOT_COLUMNS, 4, 1)
        return
    wide = (2 * launch.DOT_COLUMNS, launch.DOT_NORMED_WARPS) if normed else (launch.DOT_COLUMNS, 4)
    assert (config.block_n, config.num_warps) == wide
    blocks = -(-columns // config.block_n) * row_groups
    k_tiles = -(-in_features // config.block_k)
    share = -(-k_tiles // config.split_k)
    assert 1 <= config.split_k <= k_tiles and (config.split_k - 1) * share < k_tiles  # no empty share
    power = triton.next_power_of_2(config.split_k)  # the split chosen, before empty shares were dropped
    assert power * launch.DOT_ROWS * config.block_n <= launch.DOT_PARTIALS
    warps = launch.DOT_WARPS_PER_SM * 132
    if power > 1:  # split no further than filling the SMs and shares no deeper than DOT_SHARE_DEPTH need
        half = power // 2
        assert blocks * half * config.num_warps < warps or -(-k_tiles // half) * config.block_k > launch.DOT_SHARE_DEPTH
    filled = blocks * power * config.num_warps >= warps
    shallow = share * config.block_k <= launch.DOT_SHARE_DEPTH
    assert (filled and shallow) or power * 2 > min(k_tiles, launch.DOT_PARTIALS // (16 * config.block_n)), config


def test_llama_1b_tensor_core_launches_are_at_or_near_the_fastest_of_the_committed_grid_sweeps():
    """benchmarks/results/profile_generation-llama1b-16rows-grid.md and -4rows-grid.md (every tensor-core launch of a
    grid, at 16 and at 4 rows; their "default" column is an earlier rule's): q/k/v and down_proj take the fastest
    launch (q/k/v within 0.5% of it at 4 rows), the gated gate/up one within 4% of it, o_proj (the smallest) one
    within 1 us."""
    expected = {(3072, 2048, True, 1): (64, 128, 4, 8), (2048, 2048, False, 1): (32, 128, 8, 4),
                (16384, 2048, True, 2): (64, 64, 2, 8), (2048, 8192, False, 1): (32, 128, 8, 4)}
    for rows in (4, 16):
        for (columns, in_features, normed, matrices), shape in expected.items():
            config = launch.launch_config(columns, in_features, rows, k_contiguous=True, normed=normed,
                                          matrices=matrices)
            assert config.dot and (config.block_n, config.block_k, config.split_k, config.num_warps) == shape


def test_gpt2_4_row_launches_are_the_fastest_of_the_committed_sweep():
    """benchmarks/results/profile_generation-beam4-sweep.md: each default was the fastest launch timed for its shape
    (fused norm for c_attn and c_fc; a residual, no norm, for the two c_proj)."""
    expected = {(2304, 768, True): (32, 128, 3, 8), (768, 768, False): (32, 256, 3, 8),
                (3072, 768, True): (32, 128, 2, 8), (768, 3072, False): (32, 256, 4, 8)}
    for (columns, in_features, normed), launch_shape in expected.items():
        config = launch.launch_config(columns, in_features, 4, k_contiguous=False, normed=normed)
        assert config.dot and (config.block_n, config.block_k, config.split_k, config.num_warps) == launch_shape


def test_gpt2_launches_of_2_to_4_rows_on_the_copies_take_the_fastest_deep_tiles_of_the_committed_sweeps():
    """benchmarks/results/profile_generation-gpt2-beam4-linear-sweep.md and -beam2-linear-sweep.md: at 4 and at 2 rows
    on K-contiguous weights (the copies GPT-2's steps of up to 4 rows read) each layer was fastest on CUDA cores, one
    tile over all of K, 8 warps (or within 1% of it: attn.c_proj at 2 rows), 8 columns wide where the products allow
    (mlp.c_proj: 4 columns at 2 rows, 2 at 4); 3 rows launch as 4; 5 rows, and GPT-2's LM head (not small), tensor
    cores."""
    expected = {(2304, 768, True): {2: 8, 4: 8}, (768, 768, False): {2: 8, 4: 8}, (3072, 768, True): {2: 8, 4: 8},
                (768, 3072, False): {2: 4, 4: 2}}
    for (columns, in_features, normed), widths in expected.items():
        block_k = triton.next_power_of_2(in_features)
        for rows in (2, 3, 4):
            config = launch.launch_config(columns, in_features, rows, k_contiguous=True, normed=normed)
            block_m = triton.next_power_of_2(rows)
            assert config == launch.LaunchConfig(block_m, widths[block_m], block_k, 1, 8), (rows, config)
            assert block_m * config.block_n * block_k <= launch.FEW_ROWS_TILE
        assert launch.launch_config(columns, in_features, 5, k_contiguous=True, normed=normed).dot
        assert launch.launch_config(columns, in_features, 4, k_contiguous=False, normed=normed).dot
    assert launch.launch_config(50257, 768, 4, k_contiguous=True).dot
    gated = launch.launch_config(2 * 1024, 512, 4, k_contiguous=True, matrices=2)  # a small gated projection
    assert not gated.dot and 4 * gated.block_n * gated.block_k * 2 <= launch.FEW_ROWS_TILE


def test_one_row_half_launches_take_deep_tiles_where_the_committed_sweep_found_them_fastest():
    """benchmarks/results/profile_generation-one-row-share.md: at one row, Llama-1B's layer projections were fastest
    (or within noise of it) on shares of one tile over all of K, as wide as 16K weight elements in registers allow;
    its LM head (thousands of programs) on shares of two tiles half as deep; GPT-2's Linear LM head on one tile.
    GPT-2's Conv1D layers keep their shallow tiles on HF's layout; on the K-contiguous copies its one-token steps read,
    its small layer launches (profile_generation-gpt2-linear-sweep.md) take blocks of 4 columns where that gives them
    4 programs per SM or more (c_attn, c_proj, c_fc: the sweep's fastest, or within 5% of it for attn.c_proj) and
    keep 4 columns otherwise (mlp.c_proj, within 7% of the sweep's fastest)."""
    deep = {(3072, 2048, True, 1): (8, 2048), (2048, 2048, False, 1): (8, 2048), (16384, 2048, True, 2): (4, 2048),
            (2048, 8192, False, 1): (2, 8192), (128256, 2048, True, 1): (8, 1024), (50257, 768, True, 1): (16, 1024)}
    for (columns, in_features, normed, matrices), shape in deep.items():
        config = launch.launch_config(columns, in_features, 1, k_contiguous=True, normed=normed, matrices=matrices)
        assert (config.block_n, config.block_k, config.split_k) == (*shape, 1) and not config.dot, config
        wide = launch.launch_config(columns, in_features, 1, k_contiguous=True, normed=normed, matrices=matrices,
                                    element_size=4, half_inputs=False)
        assert wide.block_k <= launch.CONTIGUOUS_K_DEPTH  # float32 keeps the shallow tiles
    for columns, in_features in ((768, 3072), (2304, 768), (768, 768), (3072, 768)):
        config = launch.launch_config(columns, in_features, 1, k_contiguous=False, normed=True)
        assert config.block_k <= launch.CONTIGUOUS_K_DEPTH, config
    small = {(2304, 768, True): (4, 1024), (768, 768, False): (4, 1024), (3072, 768, True): (4, 1024),
             (768, 3072, False): (4, 4096)}
    for (columns, in_features, normed), shape in small.items():
        config = launch.launch_config(columns, in_features, 1, k_contiguous=True, normed=normed)
        assert (config.block_n, config.block_k, config.split_k) == (*shape, 1) and not config.dot, config


def test_only_launches_of_few_weight_bytes_per_sm_narrow_their_blocks():
    for columns in (256, 768, 2304, 3072, 8192, 32768):
        for in_features in (768, 2048, 3072, 8192):
            config = launch.launch_config(columns, in_features, 1, k_contiguous=True)
            small = columns * in_features * 2 < layers.SMALL_LAUNCH_BYTES_PER_SM * 132
            widest = min(launch.ONE_ROW_TILE // min(triton.next_power_of_2(in_features), launch.ONE_ROW_DEPTH),
                         triton.next_power_of_2(columns))
            if not small:
                assert config.block_n >= widest // 2, config  # the register-bound width (half for many waves)
            elif config.block_n > launch.SMALL_LAUNCH_MIN_COLUMNS:
                assert -(-columns // config.block_n) >= launch.SMALL_LAUNCH_PROGRAMS_PER_SM * 132, config


def test_deep_one_row_launches_hold_at_most_one_row_tile_and_split_k_only_to_fill_the_sms():
    for columns in (1, 8, 64, 256, 4096, 32768):
        for in_features in (16, 48, 1000, 2048, 8192, 14336):
            for matrices in (1, 2):
                config = launch.launch_config(matrices * columns, in_features, 1, k_contiguous=True,
                                              matrices=matrices)
                blocks = -(-columns // config.block_n)
                k_tiles = -(-in_features // config.block_k)
                share = -(-k_tiles // config.split_k)
                assert config.block_k >= min(triton.next_power_of_2(in_features), launch.ONE_ROW_DEPTH) // 2, config
                held = launch.one_row_held(config.block_n, config.block_k, in_features, matrices, config.split_k)
                assert held <= launch.ONE_ROW_TILE or config.block_n == 1, config
                assert 1 <= config.split_k <= k_tiles, config
                if config.split_k > 1:  # split only while the SMs are not filled, and into non-empty shares
                    assert blocks < 132 and blocks * (config.split_k - 1) < 132, config
                    assert (config.split_k - 1) * share < k_tiles, config


def test_one_row_programs_hold_their_shares_first_two_tiles_of_every_matrix():
    assert launch.one_row_held(8, 2048, 2048) == 8 * 2048  # one tile: all of K
    assert launch.one_row_held(8, 1024, 2048) == 2 * 8 * 1024  # two tiles, both in flight
    assert launch.one_row_held(2, 4096, 16384) == 2 * 2 * 4096  # four tiles, two in flight
    assert launch.one_row_held(4, 2048, 2048, matrices=2) == 2 * 4 * 2048  # a gated projection's two matrices
    assert launch.one_row_held(8, 1024, 4096, split_k=4) == 8 * 1024  # a split share of one tile
    assert launch.one_row_held(8, 1024, 3000, split_k=2) == 2 * 8 * 1024  # shares of two tiles, the last shorter


def test_tensor_core_blocks_are_at_least_16_each_way():
    for columns in (1, 8, 24, 40, 200):
        for in_features in (1, 12, 72, 5000):
            for k_contiguous in (False, True):
                for rows in (1, 3, 40):
                    config = launch.launch_config(columns, in_features, rows, k_contiguous=k_contiguous, dot=True)
                    assert config.dot and config.block_m == launch.DOT_ROWS
                    assert min(config.block_n, config.block_k) >= launch.DOT_MIN, config
                    assert config.split_k == 1 or config.split_k <= -(-in_features // config.block_k)


def test_forcing_a_path_is_checked():
    with pytest.raises(ValueError, match="dot=True needs x and weights of one 16-bit float dtype"):
        launch.launch_config(64, 64, 4, k_contiguous=True, half_inputs=False, dot=True)
    projection = Projection((torch.zeros(32, 64),), (None,))
    with pytest.raises(ValueError, match="dot=True needs"):
        linear.fused_linear(torch.zeros(4, 64), projection, dot=True)
    half = Projection((torch.zeros(32, 64, dtype=torch.float16),), (None,))
    with pytest.raises(ValueError, match="block_n=8, block_k=64: the tensor-core path needs both at least 16"):
        linear.fused_linear(torch.zeros(4, 64, dtype=torch.float16), half, block_n=8, dot=True)
    with pytest.raises(ValueError, match="dot=True needs"):  # fp16 x, float32 weights: no exact tl.dot
        linear.fused_linear(torch.zeros(4, 64, dtype=torch.float16), projection, dot=True)


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _projection(sizes: tuple[int, ...], in_f: int, conv1d: bool, dtype: torch.dtype) -> Projection:
    weights = tuple(_meta(in_f, n, dtype=dtype).t() if conv1d else _meta(n, in_f, dtype=dtype) for n in sizes)
    return Projection(weights, tuple(_meta(n, dtype=dtype) if conv1d else None for n in sizes))


def test_one_row_launches_of_llama_1b_compile_for_hopper_without_spills():
    """Llama-3.2-1B's one-row launches at their sizes (PDL on), on the deep tiles: norm + q/k/v, o_proj + residual,
    norm + gated SiLU, down + residual, norm + LM head widened to float32."""
    from tests.generation.hopper_compile import hopper_compile

    bf16 = torch.bfloat16
    rms = Norm("rms", _meta(2048, dtype=bf16), None, 1e-5)
    x, residual = _meta(1, 2048, dtype=bf16), (_meta(1, 2048, dtype=bf16),)
    launches = [
        lambda: linear.fused_linear(x, _projection((2048, 512, 512), 2048, False, bf16), norm=rms, pdl=True),
        lambda: linear.fused_linear(x, _projection((2048,), 2048, False, bf16), addends=residual, pdl=True),
        lambda: linear.fused_linear(x, _projection((8192, 8192), 2048, False, bf16), norm=rms, activation="silu",
                                    gated=True, pdl=True),
        lambda: linear.fused_linear(_meta(1, 8192, dtype=bf16), _projection((2048,), 8192, False, bf16),
                                    addends=residual, pdl=True),
        lambda: linear.fused_linear(x, _projection((128256,), 2048, False, bf16), norm=rms, out_dtype=torch.float32,
                                    pdl=True),
    ]
    for run in launches:
        assert hopper_compile(linear._fused_linear_kernel, run) == 1


def test_tensor_core_launches_of_4_beam_steps_compile_for_hopper():
    """GPT-2's (fp16, Conv1D) and Llama-3.2-1B's (bf16) projections at 4 rows, as their decode launches them (PDL
    on), on the tensor-core path: norm, gated, three segments, split K, addends, float32 logits."""
    from tests.generation.hopper_compile import hopper_compile

    rows, half, bf16 = 4, torch.float16, torch.bfloat16
    layer = Norm("layer", _meta(768, dtype=half), _meta(768, dtype=half), 1e-5)
    rms = Norm("rms", _meta(2048, dtype=bf16), None, 1e-5)
    launches = [
        lambda: linear.fused_linear(_meta(rows, 768, dtype=half), _projection((2304,), 768, True, half), norm=layer,
                                    pdl=True),
        lambda: linear.fused_linear(_meta(rows, 3072, dtype=half), _projection((768,), 3072, True, half),
                                    addends=(_meta(rows, 768, dtype=half),), pdl=True),
        lambda: linear.fused_linear(_meta(rows, 768, dtype=half), _projection((50257,), 768, False, half), norm=layer,
                                    out_dtype=torch.float32, pdl=True),
        lambda: linear.fused_linear(_meta(rows, 2048, dtype=bf16), _projection((2048, 512, 512), 2048, False, bf16),
                                    norm=rms, pdl=True),
        lambda: linear.fused_linear(_meta(rows, 2048, dtype=bf16), _projection((8192, 8192), 2048, False, bf16),
                                    norm=rms, activation="silu", gated=True, pdl=True),
        lambda: linear.fused_linear(_meta(rows, 8192, dtype=bf16), _projection((2048,), 8192, False, bf16),
                                    addends=(_meta(rows, 2048, dtype=bf16),), pdl=True),
    ]
    for run in launches:
        assert hopper_compile(linear._fused_linear_kernel, run) == 1
