"""How the `"ell"` kernel reads a layer's input: the planes it reads (made from the input once per call), the
offset a nonzero weight reads in them, and the plane of pixels a program computes. Two reading modes
(`mode_of`):

- `POINTWISE` (1×1 kernel, no padding): a matrix product over pixels. The planes are the input's channels
  (subsampled by a copy where the layer has a stride); a nonzero stores its input channel `c`, the kernel reads
  `c * OH * OW` plus the pixel, masked at the end of the plane. Triton knows the plane size is a multiple of 16
  where it is, so the loads of a pixel run vectorise.
- `SHIFTED` (every other layer): the input zero-padded by the layer's padding is split into SCNN's stride
  phases (`tendril.sparse.format`: virtual channel `(c * sh + r % sh) * sw + s % sw`, where the stride becomes
  1) and copied with `slack_rows` zero rows under each phase plane (`plane_hw`: `Hq × Wq`). Kernel tap `(r, s)`
  of input channel `c` stores the flat offset of its phase plane plus `(r // sh) * Wq + s // sw`. The kernel
  computes a *virtual* output plane of `OH` rows of `Wq` pixels: virtual pixel `q = oy * Wq + ox` reads offset +
  `q`, the same distance for every nonzero, so a thread's loads of one nonzero are one address plus immediate
  offsets. The virtual columns past `OW` read the next row (or the slack) and are not stored.

Every read lies inside the planes with no bounds check: the slack holds the virtual pixels of a last pixel
block of up to `MAX_PIXELS`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tendril.sparse.format import ConvGeometry

POINTWISE, SHIFTED = 0, 1
MAX_PIXELS = 512
"""The longest pixel block of a config: what the `SHIFTED` planes' slack rows cover."""


def mode_of(geometry: ConvGeometry) -> int:
    g = geometry
    return POINTWISE if g.kernel == (1, 1) and g.padding == (0, 0) else SHIFTED


def phase_hw(geometry: ConvGeometry) -> tuple[int, int]:
    """Rows and columns of one stride phase of the zero-padded input (rounded up to whole strides)."""
    g = geometry
    return tuple(-(-(n + 2 * p) // s) for n, p, s in zip(g.in_hw, g.padding, g.stride, strict=True))  # type: ignore[return-value]


def slack_rows(geometry: ConvGeometry) -> int:
    """Zero rows under each `SHIFTED` phase plane, enough for the virtual pixels of the last pixel block; none
    for `POINTWISE` layers (whose reads are masked)."""
    return 0 if mode_of(geometry) == POINTWISE else -(-MAX_PIXELS // phase_hw(geometry)[1]) + 1


def plane_hw(geometry: ConvGeometry) -> tuple[int, int]:
    """Rows and columns of each plane the kernel reads: the output's for `POINTWISE` layers, a phase plane's plus
    the slack rows for `SHIFTED` ones."""
    if mode_of(geometry) == POINTWISE:
        return geometry.out_hw
    rows, cols = phase_hw(geometry)
    return rows + slack_rows(geometry), cols


def planes_per_channel(geometry: ConvGeometry) -> int:
    return 1 if mode_of(geometry) == POINTWISE else geometry.phases


def virtual_width(geometry: ConvGeometry) -> int:
    """Pixels per row of the plane the kernel computes (a plane's columns for `SHIFTED` layers, else the
    output's)."""
    return plane_hw(geometry)[1]


def entry_offsets(geometry: ConvGeometry, c: torch.Tensor, r: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """What a nonzero at input channel `c`, kernel tap `(r, s)` stores as its offset (see the module docstring)."""
    g = geometry
    if mode_of(g) == POINTWISE:
        return c
    (sh, sw), (rows, cols) = g.stride, plane_hw(g)
    plane = (c * sh + r % sh) * sw + s % sw
    return plane * (rows * cols) + (r // sh) * cols + s // sw


def input_planes(x: torch.Tensor, geometry: ConvGeometry) -> torch.Tensor:
    """The planes the kernel reads, from a batch `x` (`[N, C, H, W]`): contiguous `[N, C * planes_per_channel,
    *plane_hw]` (`x` itself where it is already that: a contiguous input of a stride-1 `POINTWISE` layer)."""
    g = geometry
    if mode_of(g) == POINTWISE:
        return x[:, :, :: g.stride[0], :: g.stride[1]].contiguous()
    (ph, pw), (sh, sw), (rows, cols) = g.padding, g.stride, phase_hw(g)
    (h, w), slack = g.in_hw, slack_rows(g)
    if (sh, sw) == (1, 1):
        return F.pad(x, (pw, pw, ph, ph + slack))
    padded = F.pad(x, (pw, cols * sw - w - pw, ph, rows * sh - h - ph))  # whole strides: [N, C, rows*sh, cols*sw]
    phases = padded.view(x.shape[0], g.in_channels, rows, sh, cols, sw).permute(0, 1, 3, 5, 2, 4)
    return F.pad(phases, (0, 0, 0, slack)).reshape(x.shape[0], g.in_channels * sh * sw, rows + slack, cols)
