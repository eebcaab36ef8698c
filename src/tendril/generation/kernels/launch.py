"""How `linear.fused_linear` launches its kernel by default: tile shapes, K splits and the choice between the
CUDA-core and the tensor-core paths (`launch_config`), from the projection's shape and row count alone."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

from tendril.generation.kernels.layers import FEW_ROWS, SPLIT_K_LOCKS, deep_rows, is_small

TILE_BYTES = 16384
"""Weight bytes a program reads per tile by default (8192 fp16 elements), shared by its rows."""
DOT_ROWS = 16
"""Rows a program computes together on the tensor-core path, masked past the last row: the rows of one MMA tile
(a smaller block, which Triton pads to the tile itself, holds more registers)."""
DOT_TILE = 4096
"""Weight elements of a tensor-core tile by default, at most `DOT_TILE_K` deep: its input tile is normed in
float32 over all `DOT_ROWS` rows of the block and fed to the MMA beside the weights, so a one-row-sized tile
would not fit the registers (ptxas spills it)."""
DOT_TILE_K = 128
"""The deepest default tile of the tensor-core path (the depth sets the input tile's registers)."""
PLAIN_DOT_TILE = 8192
PLAIN_DOT_TILE_K = 256
"""The tensor-core tile and its deepest extent when the input needs no norm: its tile is loaded as it is, in
the 16-bit dtype, so a tile twice as large and as deep fits the registers (fewer, longer loads a program)."""
DOT_FILL = 2
"""A tensor-core launch on Conv1D weights splits K until it has 1/`DOT_FILL` as many programs as SMs, not one per
SM: every split adds float32 partials that the column block's last program reads back (a round trip through L2 on the
critical path), which for those small launches costs more than the SMs left idle read."""
DOT_WAVE_TILE = 8192
"""Weight elements of the tiles an SM holds at once in `DOT_WIDE_WARPS`-warp tensor-core programs on Conv1D weights
(two `DOT_TILE` programs, one `PLAIN_DOT_TILE` program): a launch of more such programs than one wave of SMs holds
runs a second, nearly empty wave, so its split is lowered to fit one wave when that still fills `DOT_FILL`."""
DOT_WIDE_WARPS = 8
"""Warps of a tensor-core program on Conv1D weights when the launch fits one wave (`DOT_WAVE_TILE`): four warps leave
its loads' latency uncovered; larger launches keep four, which an SM holds more of."""
CONTIGUOUS_K_DEPTH = 512
"""The deepest CUDA-core tile when the inputs are contiguous in memory (nn.Linear) and this many divide them
(no masked tail tile) and the tile stays at least 16 columns wide: longer contiguous runs per weight row."""
UNSPLIT_PROGRAMS_PER_SM = 4
"""A launch with this many programs per SM without splitting K is not split: the tiles prefetched before a
programmatic dependent launch's wait only help the programs of the first wave, and the split's reduction costs
every column block."""
DOT_PARTIALS = 8192
"""Float32 partial sums the split-K reduction of a tensor-core launch reads at once (splits x `DOT_ROWS` x
`BLOCK_N`, the padding rows included): the split is capped to keep them in registers."""
DOT_MIN = 16
"""The smallest `BLOCK_N` and `BLOCK_K` of the tensor-core path: K of a 16-bit `tl.dot` must be at least 16, and
narrower columns would leave most of each MMA tile padding."""
PREFETCHED_TILES = 2
"""Weight tiles a program loads before it waits for the previous kernel (and keeps in flight in its loop)."""
CONTIGUOUS_ROW_COLUMNS = 16
"""Columns of a tile when columns are contiguous in memory (Conv1D): 32 bytes of fp16, one memory sector."""
ONE_ROW_TILE = 16384
"""Weight elements a one-row 16-bit program on the deep-tile rule (`launch_config`) holds in registers at once: its
tiles in flight (its share's first two at most), of every matrix it reads (two when gated). A program holding more
spills registers at 4 warps."""
ONE_ROW_DEPTH = 8192
"""The deepest one-row tile on contiguous inputs (nn.Linear)."""
DOT_COLUMNS = 32
"""Columns of a 4-warp tensor-core program on nn.Linear weights (`_dot_k_contiguous`): two MMA tiles wide."""
DOT_NORMED_WARPS = 8
"""Warps of a tensor-core program on nn.Linear weights that norms its input: each program computes the norm's
statistics of its rows and norms its input tiles, so a program of twice the columns (and warps) does that once
where two would each do it."""
DOT_WARPS_PER_SM = 8
"""A tensor-core launch on nn.Linear weights splits K until its programs hold this many warps per SM
(`_dot_k_contiguous`)..."""
DOT_SHARE_DEPTH = 1024
"""... and until no program's share of K is deeper than this."""
ONE_ROW_PROGRAMS_PER_SM = 32
"""A deep-tile launch of more programs per SM than this (an LM head) runs many waves; there a program's share is two
tiles of half the depth, so the second tile's loads overlap the first's products."""
SMALL_LAUNCH_PROGRAMS_PER_SM = 4
SMALL_LAUNCH_MIN_COLUMNS = 4
"""A one-row deep-tile launch of a small projection (`layers.SMALL_LAUNCH_BYTES_PER_SM`: bound by memory latency,
its time a few round trips, which more programs resident on an SM overlap) narrows its column blocks (halving, down
to `SMALL_LAUNCH_MIN_COLUMNS`) until it has `SMALL_LAUNCH_PROGRAMS_PER_SM` programs per SM."""
FEW_ROWS_TILE = 32768
FEW_ROWS_COLUMNS = 8
FEW_ROWS_WARPS = 8
"""A deep-tile launch of 2 to `FEW_ROWS` rows (`_few_rows_deep`) holds up to `FEW_ROWS_TILE` products (rows x
columns x depth, over every matrix it reads) a program, at `FEW_ROWS_WARPS` warps, in blocks of at most
`FEW_ROWS_COLUMNS` columns (wider ones, which fewer rows would allow, leave fewer programs to overlap the memory
latency these small launches are bound by): its share is all of K in one tile where that fits, so every weight it
needs loads before the programmatic dependent launch's wait."""


@dataclass(frozen=True)
class LaunchConfig:
    """How `fused_linear` launches its kernel: `BLOCK_M` rows x `BLOCK_N` columns per program, `BLOCK_K` deep
    weight tiles, K split over `split_k` programs; `dot`: products on tensor cores (`tl.dot`) rather than as
    a broadcast multiply and sum on CUDA cores."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    dot: bool = False


def _without_empty_shares(k_tiles: int, split_k: int) -> int:
    """The fewest shares of `k_tiles` tiles that keep each share as long as `split_k` shares would: none empty."""
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, split_k))


def _pow2_at_most(value: int) -> int:
    return 1 << (max(value, 1).bit_length() - 1)


@functools.lru_cache(maxsize=256)
def launch_config(
    columns: int,
    in_features: int,
    rows: int,
    *,
    k_contiguous: bool,
    element_size: int = 2,
    sm_count: int = 132,
    half_inputs: bool = True,
    normed: bool = False,
    dot: bool | None = None,
    matrices: int = 1,
) -> LaunchConfig:
    """The default launch of a projection with `columns` weight columns (all segments counted as one matrix:
    a gated program reads a tile of each of its two), `in_features` inputs and `rows` rows; `half_inputs`: x and
    the weights are both fp16 or both bf16; `normed`: the kernel norms x first; `dot` forces a path (None: the
    default below); `matrices`: weight tiles a program reads at once (2 for a gated projection).

    One row of 16-bit inputs contiguous in memory (nn.Linear) takes deep tiles first (`_one_row_deep`): a program
    owns a few columns over all of K (up to `ONE_ROW_DEPTH`), so its whole share of the weights loads before the
    programmatic dependent launch's wait, it reads the input once, and it reduces its products across threads once.
    So do 2 to `FEW_ROWS` rows of a small projection (`layers.deep_rows`), whose time is latency more than bandwidth
    (`_few_rows_deep`). Conv1D weights (contiguous columns: a deep tile reads short runs of each row) and float32
    inputs keep the tiles below.

    Two paths. The CUDA-core path multiplies a `[rows, BLOCK_K]` input tile by a `[BLOCK_K, BLOCK_N]` weight tile
    as a broadcast product summed over K: right for one row (a matrix-vector product has nothing for tensor
    cores), but its cost grows with the rows, so it shrinks the weight tile per row (`TILE_BYTES` shared by up
    to `FEW_ROWS` rows): more, smaller tiles. The tensor-core path (`dot`, the default for more than
    one row of half inputs otherwise) pads the rows to a `DOT_ROWS` block and accumulates `tl.dot` products in float32:
    an MMA instruction takes 16 rows at once and the padding is never loaded, so up to 16 rows share each
    weight tile, read once, and the launch is the same for any of them. On nn.Linear weights it is
    `_dot_k_contiguous`'s; on Conv1D weights tiles of `DOT_TILE` elements, at most `DOT_TILE_K` deep
    (`PLAIN_DOT_TILE`, `PLAIN_DOT_TILE_K` without a norm), K split no further than `DOT_PARTIALS` allows and than
    1/`DOT_FILL` of the SMs needs, lowered to fit one wave (`DOT_WAVE_TILE`), and `DOT_WIDE_WARPS` for a launch of
    one wave. Its products are exact (DTYPE x DTYPE in float32; the normed
    input is rounded to DTYPE before them either way), so only the summation order differs between the paths.
    float32 inputs keep the CUDA-core path: `tl.dot` on float32 rounds its inputs to TF32.

    Under programmatic dependent launch (`pdl.py`) a program's weight loads overlap the previous kernel
    only for the tiles it loads before its wait, `PREFETCHED_TILES`; so K is split until no program has
    more (unless the launch has `UNSPLIT_PROGRAMS_PER_SM` without splitting), and a split-K reduction (a round
    trip through L2 on the critical path) is avoided when it can be. CUDA-core tiles of `TILE_BYTES`, shaped for
    coalesced reads: 256 (or `CONTIGUOUS_K_DEPTH`) deep when the inputs are contiguous in memory (nn.Linear),
    `CONTIGUOUS_ROW_COLUMNS` wide when the columns are (Conv1D). If that leaves fewer programs than SMs, K is
    split down to one tile per program, then tiles get shallower (down to 32). Splitting needs a counter per
    column block and row group, so launches with more than `layers.SPLIT_K_LOCKS` of those (which fill the GPU
    anyway) do not split. A CUDA-core launch of Conv1D weights that splits anyway takes one tile per program,
    twice as wide and half as deep. The profile tool's `--sweep` times this choice against other launch
    configurations, on both paths for several rows, for a model's batch-1 projections
    (`benchmarks/tools/profile_generation.py`)."""
    if dot and not half_inputs:
        raise ValueError("dot=True needs x and weights of one 16-bit float dtype (fp16 or bf16): tl.dot on float32 "
                         "rounds its inputs to TF32")
    deep = (half_inputs and k_contiguous and element_size == 2
            and rows <= deep_rows(columns, in_features, element_size, sm_count))
    dot = (half_inputs and rows > 1 and not deep) if dot is None else dot
    if deep and not dot:
        if rows == 1:
            return _one_row_deep(columns, in_features, sm_count, matrices)
        return _few_rows_deep(columns, in_features, rows, matrices)
    if dot and k_contiguous:
        return _dot_k_contiguous(columns, in_features, rows, sm_count, matrices, normed)
    block_m = DOT_ROWS if dot else min(triton.next_power_of_2(max(rows, 1)), FEW_ROWS)
    tile = TILE_BYTES // element_size // block_m
    if dot:
        dot_tile, depth = (DOT_TILE, DOT_TILE_K) if normed else (PLAIN_DOT_TILE, PLAIN_DOT_TILE_K)
        block_k = max(min(triton.next_power_of_2(in_features), depth), DOT_MIN)
        block_n = max(_pow2_at_most(dot_tile // block_k), DOT_MIN)
    elif k_contiguous:
        deep = in_features % CONTIGUOUS_K_DEPTH == 0 and tile >= 16 * CONTIGUOUS_K_DEPTH
        block_k = CONTIGUOUS_K_DEPTH if deep else min(triton.next_power_of_2(in_features), 256)
        block_n = max(_pow2_at_most(tile // block_k), 8)
    else:
        block_n = min(triton.next_power_of_2(columns), CONTIGUOUS_ROW_COLUMNS)
        block_k = min(max(_pow2_at_most(tile // block_n), 16), triton.next_power_of_2(in_features))
    programs_per_split = triton.cdiv(columns, block_n) * triton.cdiv(rows, block_m)
    enough = sm_count // DOT_FILL if dot else sm_count
    many = programs_per_split >= UNSPLIT_PROGRAMS_PER_SM * sm_count
    while True:
        k_tiles = triton.cdiv(in_features, block_k)
        split_k = 1 if many else triton.cdiv(k_tiles, PREFETCHED_TILES)
        if programs_per_split * split_k < enough:
            split_k = k_tiles
        if programs_per_split * split_k >= enough or block_k <= 32:
            break
        block_k //= 2
    if programs_per_split > SPLIT_K_LOCKS:
        split_k = 1
    elif dot:  # the last program reads every split's partials of its block at once: they must fit the registers
        split_k = min(split_k, max(_pow2_at_most(DOT_PARTIALS // (block_m * block_n)), 1))
        in_one_wave = sm_count * DOT_WAVE_TILE // (block_n * block_k) // programs_per_split
        if in_one_wave < split_k and programs_per_split * in_one_wave >= enough:
            split_k = in_one_wave
    elif 1 < split_k < k_tiles and not k_contiguous and block_k >= 64:
        # the reduction is paid anyway: one tile per program, twice as wide (longer contiguous reads)
        block_n, block_k = block_n * 2, block_k // 2
        k_tiles = split_k = triton.cdiv(in_features, block_k)
    split_k = _without_empty_shares(k_tiles, split_k)
    one_wave = programs_per_split * split_k * block_n * block_k <= sm_count * DOT_WAVE_TILE
    return LaunchConfig(block_m, block_n, block_k, split_k, num_warps=DOT_WIDE_WARPS if dot and one_wave else 4,
                        dot=dot)


def share_tiles(in_features: int, block_k: int, split_k: int) -> int:
    """Tiles of K in a program's share (the last share may be shorter): what the kernel's loop walks."""
    return triton.cdiv(triton.cdiv(in_features, block_k), split_k)


def one_row_held(block_n: int, block_k: int, in_features: int, matrices: int = 1, split_k: int = 1) -> int:
    """Weight elements a one-row program of this launch holds in registers at once, what `ONE_ROW_TILE` bounds: its
    share's tiles in flight (the first `PREFETCHED_TILES` at most), of every matrix it reads."""
    return block_n * block_k * matrices * min(share_tiles(in_features, block_k, split_k), PREFETCHED_TILES)


def _dot_k_contiguous(columns: int, in_features: int, rows: int, sm_count: int, matrices: int,
                      normed: bool) -> LaunchConfig:
    """The tensor-core launch on nn.Linear weights (`launch_config`): 4-warp programs of `DOT_COLUMNS` columns whose
    tiles are `DOT_TILE // DOT_COLUMNS` deep over every matrix they read (a gated program's tiles are half as deep).
    A launch of more column blocks than `layers.SPLIT_K_LOCKS` (an LM head) fills the GPU many times over and keeps
    these small programs, unsplit. A smaller one takes programs of twice the columns and `DOT_NORMED_WARPS` when they
    norm their input, and splits K in powers of two until its programs hold `DOT_WARPS_PER_SM` warps per SM and no
    share is deeper than `DOT_SHARE_DEPTH` (as far as `DOT_PARTIALS` lets the reduction hold the partials in
    registers): many programs of short shares keep every SM streaming weights, and what a split's reduction costs
    is less than what the SMs a shallower split leaves idle, or a deep share's single program, would cost."""
    block_k = max(min(triton.next_power_of_2(in_features), DOT_TILE // (DOT_COLUMNS * matrices)), DOT_MIN)
    k_tiles = triton.cdiv(in_features, block_k)
    row_groups = triton.cdiv(rows, DOT_ROWS)
    if triton.cdiv(columns // matrices, DOT_COLUMNS) * row_groups > SPLIT_K_LOCKS:
        return LaunchConfig(DOT_ROWS, DOT_COLUMNS, block_k, 1, dot=True)
    block_n, num_warps = (DOT_COLUMNS * 2, DOT_NORMED_WARPS) if normed else (DOT_COLUMNS, 4)
    column_blocks = triton.cdiv(columns // matrices, block_n) * row_groups
    most = min(k_tiles, _pow2_at_most(DOT_PARTIALS // (DOT_ROWS * block_n)))
    split_k = 1
    while split_k * 2 <= most and (column_blocks * split_k * num_warps < DOT_WARPS_PER_SM * sm_count
                                   or triton.cdiv(k_tiles, split_k) * block_k > DOT_SHARE_DEPTH):
        split_k *= 2
    return LaunchConfig(DOT_ROWS, block_n, block_k, _without_empty_shares(k_tiles, split_k), num_warps, dot=True)


def _one_row_deep(columns: int, in_features: int, sm_count: int, matrices: int) -> LaunchConfig:
    """The deep-tile launch of a one-row 16-bit projection on K-contiguous weights (`launch_config`): shares of one
    tile (two for launches of many waves, `ONE_ROW_PROGRAMS_PER_SM`) as wide as `ONE_ROW_TILE` allows (narrower for
    small launches, `layers.is_small`), K split only when the launch would leave SMs idle."""
    per_matrix = columns // matrices
    block_k = min(triton.next_power_of_2(in_features), ONE_ROW_DEPTH)

    def width(depth: int) -> int:  # the widest block whose tiles in flight fit ONE_ROW_TILE
        column = one_row_held(1, depth, in_features, matrices)
        return min(max(_pow2_at_most(ONE_ROW_TILE // column), 1), triton.next_power_of_2(per_matrix))

    block_n = width(block_k)
    if triton.cdiv(per_matrix, block_n) > ONE_ROW_PROGRAMS_PER_SM * sm_count and block_k > 1:
        block_k //= 2
        block_n = width(block_k)
    small = is_small(columns, in_features, 2, sm_count)
    while (small and block_n > SMALL_LAUNCH_MIN_COLUMNS
           and triton.cdiv(per_matrix, block_n) < SMALL_LAUNCH_PROGRAMS_PER_SM * sm_count):
        block_n //= 2
    column_blocks = triton.cdiv(per_matrix, block_n)
    k_tiles = triton.cdiv(in_features, block_k)
    split_k = 1
    if column_blocks < sm_count and column_blocks <= SPLIT_K_LOCKS:
        split_k = _without_empty_shares(k_tiles, min(k_tiles, triton.cdiv(sm_count, column_blocks)))
    return LaunchConfig(1, block_n, block_k, split_k)


def _few_rows_deep(columns: int, in_features: int, rows: int, matrices: int) -> LaunchConfig:
    """The deep-tile launch of 2 to `FEW_ROWS` rows of a small 16-bit projection on K-contiguous weights
    (`launch_config`): one tile over all of K where `FEW_ROWS_TILE` holds one column of it, as wide as
    `FEW_ROWS_TILE` then allows up to `FEW_ROWS_COLUMNS`, K unsplit."""
    block_m = triton.next_power_of_2(rows)
    block_k = min(triton.next_power_of_2(in_features), _pow2_at_most(FEW_ROWS_TILE // (block_m * matrices)))
    block_n = min(_pow2_at_most(FEW_ROWS_TILE // (block_m * block_k * matrices)), FEW_ROWS_COLUMNS,
                  triton.next_power_of_2(columns // matrices))
    return LaunchConfig(block_m, block_n, block_k, 1, num_warps=FEW_ROWS_WARPS)
