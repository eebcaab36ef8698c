"""The register-tiled kernel's algorithm (`kernel.py`) block for block on the CPU, for CI.

Same grid (tiles × k-blocks × channel splits, blocks run in a caller-chosen order so that any block
can be the last of its tile), same staging (input tile with halo, zeros in the padding; `c_chunk`
channels per round; the round's nonzero values must fit `value_capacity`), same decoding of the
records (one per (k, c, row group); a tap's value is found at the record's offset plus the set bits
below it), the same split reduction (partials in a NaN-poisoned workspace, the last block of a tile
sums them in split order) and fused epilogue, and the same per-tile nonzero counts. A warp's lanes
partition the tile (idle lanes write nothing), and double buffering only reorders copies, so the
emulation computes a block's tile as a whole, one staged round at a time. Slow by design: use it on
small shapes.

Pixel-run plans (1×1 kernels) run the same way on the flattened `[K, 1, H·W]` output: each block stages
its run of `32 × pw` output pixels per channel (gathered from the strided input, zeros past the plane),
decodes one record per warp (bit kk: the warp's output channel kk has a weight; values at the record's
offset plus the set bits below it; a warp with an empty record skips the channel), and counts the
nonzeros of its `1 / tiles` share of the flattened input plane.
"""

from __future__ import annotations

import torch

from tendril.sparse.ops.conv.register.tiling import RegisterTilePlan, RowMaskWeights


def conv(
    x: torch.Tensor,
    weights: RowMaskWeights,
    bias: torch.Tensor,
    *,
    residual: torch.Tensor | None = None,
    relu: bool = False,
    block_order: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`([relu](conv(x) + bias + residual), counts)` as the kernel computes them; `block_order`
    shuffles the order in which blocks run (None: grid order)."""
    plan = weights.plan
    g = plan.geometry
    out_hw = plan.out_extent_hw  # the tiles' view of the output plane ((1, H·W) for pixel runs)
    if residual is not None:
        residual = residual.reshape(g.out_channels, *out_hw)
    out = torch.full((g.out_channels, *out_hw), float("nan"))
    workspace = torch.full((plan.splits, g.out_channels, *out_hw), float("nan"))
    tiles, k_blocks, splits = plan.grid
    tickets = torch.zeros(tiles * k_blocks, dtype=torch.int64)
    counts = torch.zeros(g.groups * splits * tiles, dtype=torch.int32)
    blocks = [(tile, kb, split) for split in range(splits) for kb in range(k_blocks) for tile in range(tiles)]
    # CPU emulation only (never captured): a random program order shows the result does not depend on it
    order = range(len(blocks)) if block_order is None else torch.randperm(len(blocks), generator=block_order).tolist()
    for index in order:
        tile, kb, split = blocks[index]
        if plan.pixel_run:
            acc = _run_sums(x, weights, tile, kb, split)[:, None]
            _count_run(x, plan, tile, kb, split, counts)
        else:
            acc = _block_sums(x, weights, tile, kb, split)
            _count(x, plan, tile, kb, split, counts)
        k0, k_count, (oy0, ox0), (rows, cols) = _block_extent(plan, tile, kb)
        target = (slice(k0, k0 + k_count), slice(oy0, oy0 + rows), slice(ox0, ox0 + cols))
        if splits > 1:
            workspace[(split, *target)] = acc[:k_count, :rows, :cols]
            tickets[kb * tiles + tile] += 1
            if tickets[kb * tiles + tile] != splits:
                continue
            tickets[kb * tiles + tile] = 0
            total = torch.zeros(k_count, rows, cols)
            for z in range(splits):
                total += workspace[(z, *target)]
        else:
            total = acc[:k_count, :rows, :cols]
        y = total + bias[k0 : k0 + k_count, None, None]
        if residual is not None:
            y = y + residual[target]
        out[target] = y.relu() if relu else y
    assert not tickets.any(), "every tile's last block resets its ticket"
    return out.view(g.out_channels, *g.out_hw), counts


def _block_extent(plan: RegisterTilePlan, tile: int, kb: int) -> tuple[int, int, tuple[int, int], tuple[int, int]]:
    """A block's first output channel, channel count, tile origin and valid tile size."""
    (oh, ow), (th, tw) = plan.out_extent_hw, plan.tile_hw
    tiles_x = plan.tiles[1]
    oy0, ox0 = (tile // tiles_x) * th, (tile % tiles_x) * tw
    group, local = divmod(kb, plan.k_blocks_per_group)
    k_local0 = local * plan.k_block
    k_count = min(plan.k_block, plan.group_out - k_local0)
    return group * plan.group_out + k_local0, k_count, (oy0, ox0), (min(th, oh - oy0), min(tw, ow - ox0))


def _block_sums(x: torch.Tensor, weights: RowMaskWeights, tile: int, kb: int, split: int) -> torch.Tensor:
    """One block's `[k_block, tile_h, tile_w]` accumulators over its split of the input channels."""
    plan = weights.plan
    g = plan.geometry
    s_size, (sh, sw), (th, tw), (in_h, in_w) = g.kernel[1], g.stride, plan.tile_hw, plan.in_hw
    tiles_x = plan.tiles[1]
    iy0 = (tile // tiles_x) * th * sh - g.padding[0]
    ix0 = (tile % tiles_x) * tw * sw - g.padding[1]
    group = kb // plan.k_blocks_per_group
    c_begin = split * plan.split_channels
    c_end = min(plan.group_in, c_begin + plan.split_channels)
    acc = torch.zeros(plan.k_block, th, tw)
    for c0 in range(c_begin, c_end, plan.c_chunk):
        chunk = min(plan.c_chunk, c_end - c0)
        channels = group * plan.group_in + c0
        staged = _stage(x[channels : channels + chunk], iy0, ix0, in_h, in_w)
        records = weights.records[kb, c0 : c0 + chunk].long()  # [chunk, row groups, k_block]
        v_begin = int(weights.chan_ptr[kb, c0])
        v_count = int(weights.chan_ptr[kb, c0 + chunk]) - v_begin
        assert v_count <= plan.value_capacity, "a round's nonzero values overflow the staged value buffer"
        values = weights.values[v_begin : v_begin + v_count]
        for cc in range(chunk):
            base = int(weights.chan_ptr[kb, c0 + cc]) - v_begin
            for row_group in range(plan.record_groups):
                record = records[cc, row_group]
                mask, offset = record & 0xFFFF, record >> 16
                below = torch.zeros_like(mask)
                for t in range(plan.record_rows * s_size):
                    present = ((mask >> t) & 1).bool()
                    if present.any():
                        r, s = row_group * plan.record_rows + t // s_size, t % s_size
                        index = (base + offset + below).clamp(max=max(v_count - 1, 0))
                        weight = torch.where(present, values[index], 0.0)
                        patch = staged[cc, r : r + (th - 1) * sh + 1 : sh, s : s + (tw - 1) * sw + 1 : sw]
                        acc += weight[:, None, None] * patch
                    below += present.long()
    return acc


def _stage(planes: torch.Tensor, iy0: int, ix0: int, in_h: int, in_w: int) -> torch.Tensor:
    """`[chunk, in_h, in_w]`: the input tile with its halo starting at (iy0, ix0), zeros outside the input."""
    chunk, height, width = planes.shape
    staged = torch.zeros(chunk, in_h, in_w)
    y_lo, y_hi = max(iy0, 0), min(iy0 + in_h, height)
    x_lo, x_hi = max(ix0, 0), min(ix0 + in_w, width)
    if y_lo < y_hi and x_lo < x_hi:
        staged[:, y_lo - iy0 : y_hi - iy0, x_lo - ix0 : x_hi - ix0] = planes[:, y_lo:y_hi, x_lo:x_hi]
    return staged


def _count(x: torch.Tensor, plan: RegisterTilePlan, tile: int, kb: int, split: int, counts: torch.Tensor) -> None:
    """The first k-block of each group counts the nonzeros of its tile's share of the input plane."""
    if kb % plan.k_blocks_per_group:
        return
    g = plan.geometry
    (in_h, in_w), (sh, sw), (th, tw) = g.in_hw, g.stride, plan.tile_hw
    tiles_y, tiles_x = plan.tiles
    ty, tx = divmod(tile, tiles_x)
    iy0, ix0 = ty * th * sh - g.padding[0], tx * tw * sw - g.padding[1]
    y_lo = 0 if ty == 0 else min(max(iy0, 0), in_h)
    y_hi = in_h if ty == tiles_y - 1 else min(max(iy0 + th * sh, 0), in_h)
    x_lo = 0 if tx == 0 else min(max(ix0, 0), in_w)
    x_hi = in_w if tx == tiles_x - 1 else min(max(ix0 + tw * sw, 0), in_w)
    group = kb // plan.k_blocks_per_group
    c_begin = group * plan.group_in + split * plan.split_channels
    c_end = group * plan.group_in + min(plan.group_in, (split + 1) * plan.split_channels)
    found = int((x[c_begin:c_end, y_lo:y_hi, x_lo:x_hi] != 0).sum()) if c_begin < c_end else 0
    counts[(group * plan.splits + split) * plan.grid[0] + tile] = found


def _run_sums(x: torch.Tensor, weights: RowMaskWeights, tile: int, kb: int, split: int) -> torch.Tensor:
    """A pixel-run block's `[k_block, 32 × pw]` accumulators over its split of the input channels."""
    plan = weights.plan
    run, kt = plan.tile_hw[1], plan.kt
    group = kb // plan.k_blocks_per_group
    c_begin = split * plan.split_channels
    c_end = min(plan.group_in, c_begin + plan.split_channels)
    acc = torch.zeros(plan.warps, kt, run)
    for c0 in range(c_begin, c_end, plan.c_chunk):
        chunk = min(plan.c_chunk, c_end - c0)
        channels = group * plan.group_in + c0
        staged = _stage_run(x[channels : channels + chunk], plan, tile * run)
        records = weights.records[kb, c0 : c0 + chunk, 0].long()  # [chunk, warps]
        v_begin = int(weights.chan_ptr[kb, c0])
        v_count = int(weights.chan_ptr[kb, c0 + chunk]) - v_begin
        assert v_count <= plan.value_capacity, "a round's nonzero values overflow the staged value buffer"
        values = weights.values[v_begin : v_begin + v_count]
        for cc in range(chunk):
            mask, offset = records[cc] & 0xFFFF, records[cc] >> 16
            if not mask.any():
                continue  # every warp's record is empty: each skips the channel
            base = int(weights.chan_ptr[kb, c0 + cc]) - v_begin
            below = torch.zeros_like(mask)
            for kk in range(kt):
                present = ((mask >> kk) & 1).bool()
                index = (base + offset + below).clamp(max=max(v_count - 1, 0))
                weight = torch.where(present, values[index], 0.0)  # [warps]
                acc[:, kk] += weight[:, None] * staged[cc]
                below += present.long()
    return acc.view(plan.k_block, run)


def _stage_run(planes: torch.Tensor, plan: RegisterTilePlan, p0: int) -> torch.Tensor:
    """`[chunk, 32 × pw]`: output pixels [p0, p0 + run)'s input values (1×1, no padding), zeros past the plane."""
    (oh, ow), (sh, sw), run = plan.geometry.out_hw, plan.geometry.stride, plan.tile_hw[1]
    chunk = planes.shape[0]
    staged = torch.zeros(chunk, run)
    p = torch.arange(p0, min(p0 + run, oh * ow))
    staged[:, : p.numel()] = planes[:, (p // ow) * sh, (p % ow) * sw]
    return staged


def _count_run(x: torch.Tensor, plan: RegisterTilePlan, tile: int, kb: int, split: int, counts: torch.Tensor) -> None:
    """A pixel run's share of the nonzero count: its `1 / tiles` slice of the flattened input plane."""
    if kb % plan.k_blocks_per_group:
        return
    tiles = plan.grid[0]
    in_plane = plan.geometry.in_hw[0] * plan.geometry.in_hw[1]
    share = -(-in_plane // tiles)
    lo = min(tile * share, in_plane)
    hi = min(lo + share, in_plane)
    group = kb // plan.k_blocks_per_group
    c_begin = group * plan.group_in + split * plan.split_channels
    c_end = group * plan.group_in + min(plan.group_in, (split + 1) * plan.split_channels)
    flat = x.reshape(x.shape[0], -1)
    found = int((flat[c_begin:c_end, lo:hi] != 0).sum()) if c_begin < c_end else 0
    counts[(group * plan.splits + split) * tiles + tile] = found
