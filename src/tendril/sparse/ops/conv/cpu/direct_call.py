"""The direct dataflow's kernel call (`cpu_kernels.conv_direct`) for one layer: its arguments worked out from a
`CpuConvPlan` and a thread count once, so that a prepared layer (`prepared.PreparedConv`) passes only its buffers at
each call; and the split of the kernel's work into units (bands of output rows × blocks of output channels)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tendril.sparse.ops.cpu_threads import kernels

if TYPE_CHECKING:
    from tendril.sparse.ops.conv.cpu.kernel import CpuConvPlan

UNITS_PER_THREAD = 4
"""Work units (band, channel block) the direct kernel gets per thread on several threads."""
WRITE_WEIGHTS = 2
"""What zeroing a channel's band accumulators and writing them out costs the direct kernel, counted in weights: a
channel's share of a unit's work is its padded weights plus this (`channel_blocks`)."""
VECTOR_FLOATS = 8
"""The direct dataflow's bands are rounded up to this many floats (a multiple of the compiled loop's vector width),
where the reads stay inside the planes, so that its vectorized loop covers them without a scalar remainder."""

NOT_COUNTED = np.empty((0, 0), dtype=np.int32)
"""The direct kernel's `band_counts` where its output's nonzeros are not kept."""


def channel_blocks(k_ptr: torch.Tensor, blocks: int) -> np.ndarray:
    """`blocks + 1` output channel boundaries (int64, from 0 to K) that split the direct kernel's work into blocks of
    about equal cost: each channel's padded weights plus `WRITE_WEIGHTS`. Equal channel counts would not do: the
    threads take their units statically, so the block with the most nonzeros sets a layer's time."""
    channels = k_ptr.numel() - 1
    if blocks == 1:  # one thread: no torch ops on an unprepared call's path
        return np.array([0, channels], dtype=np.int64)
    cost = k_ptr.double() + WRITE_WEIGHTS * torch.arange(channels + 1, dtype=torch.float64)
    targets = cost[-1] * torch.arange(1, blocks, dtype=torch.float64) / blocks
    inner = torch.searchsorted(cost, targets).clamp(1, max(channels - 1, 1))
    return torch.cat([torch.zeros(1, dtype=torch.int64), inner, torch.full((1,), channels)]).numpy()


@dataclass(frozen=True)
class DirectCall:
    """The direct kernel's arguments that stay the same from call to call of a layer: where in its output rows the
    output grid lies, bias, ReLU, the plan's weights as numpy arrays and the work split for a thread count (built per
    call by `conv_dense_input`, once by a prepared layer, which then passes only the output, residual, input planes
    and counts buffer at each call)."""

    arguments: tuple[object, ...]
    """`(out_at, out_row, out_h, out_w, bias, relu, values, base, k_ptr, reach, row, band_rows, k_starts, vector)`,
    `conv_direct`'s last arguments."""
    bands: int
    """Bands of output rows (the first dimension of the kernel's `band_counts`)."""

    @classmethod
    def of(
        cls, plan: CpuConvPlan, threads: int, bias: np.ndarray, relu: bool, grid: tuple[int, int] | None = None
    ) -> DirectCall:
        """The call for `plan`; `grid` is `(out_at, out_row)`, where output row `y` of a channel starts in that
        channel's row of the `[K, ·]` output (None: a contiguous `[K, OH, OW]` output, `(0, OW)`)."""
        g = plan.weights.geometry
        (oh, ow) = g.out_hw
        bands = -(-oh // plan.band_rows)
        k_blocks = min(g.out_channels, -(-UNITS_PER_THREAD * threads // bands)) if threads > 1 else 1
        weights = (plan.direct_values.numpy(), plan.direct_base.numpy(), plan.k_ptr.numpy(), plan.direct_reach.numpy())
        k_starts = channel_blocks(plan.k_ptr, k_blocks)
        out_at, out_row = (0, ow) if grid is None else grid
        layout = (out_at, out_row, oh, ow)
        return cls((*layout, bias, relu, *weights, plan.row, plan.band_rows, k_starts, VECTOR_FLOATS), bands)

    def run(
        self, out: np.ndarray, residual: np.ndarray, planes: np.ndarray, band_counts: np.ndarray = NOT_COUNTED
    ) -> None:
        """`out = [relu](bias + residual + conv(planes))`: `out` `[K, ·]` (each channel's output grid as `grid`
        says), `residual` `[K, OH, OW]` or `[0, 0, 0]` (none), `planes` flat; with `band_counts` (`[bands, K]`), the
        nonzeros written per band and channel."""
        kernels().conv_direct(out, residual, planes, band_counts, *self.arguments)
