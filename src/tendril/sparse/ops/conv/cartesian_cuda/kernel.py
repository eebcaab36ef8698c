"""Sparse×sparse convolution in CUDA C++ (NVRTC): SCNN's Cartesian product into shared-memory tiles.

The Triton kernel (`cartesian_triton`) must scatter every product into global memory with an atomic, so it
is bound by the atomics. Here each thread block accumulates an
output tile (`tiling.py`: full-width rows × a block of output channels) in shared memory, so the
products' atomics stay on chip, and global memory sees one read of the init (bias + residual) and
one write of the finished tile, with the ReLU fused into that write.

Inside a block, each warp takes one input channel at a time (channels are independent: their
products meet only in the accumulators); within the warp `act_lanes` lanes walk the band's
activations (consecutive activations of a row go to consecutive lanes, so their products hit
consecutive shared-memory words: few bank conflicts) and the remaining `32 / act_lanes` lanes split
the weights, which lanes of one group read together (one broadcast load). The whole algorithm,
tiling and halos included, is mirrored on the CPU
by `emulation.py`, which CI checks against the reference. The CUDA C++ source is `scnn_conv_tiled.cu`, beside
this module, handed to NVRTC as it is (`source`) with the tile constants as `-D` defines.
"""

from __future__ import annotations

import ctypes
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tendril.sparse.activations import CompressedActivations
from tendril.sparse.format import SparseConvWeights
from tendril.sparse.ops.conv.cartesian_cuda.tiling import ACC_CAPACITY, THREADS, TiledWeights

if TYPE_CHECKING:
    from tendril.cuda.nvrtc import Kernel

KERNEL_NAME = "scnn_conv_tiled"
SOURCE_FILE = f"{KERNEL_NAME}.cu"


@cache
def source() -> str:
    """The kernel's CUDA C++ (`scnn_conv_tiled.cu`, package data beside this module)."""
    return Path(__file__).with_name(SOURCE_FILE).read_text(encoding="utf-8")


def compile_options() -> tuple[str, ...]:
    """The `-D` defines NVRTC compiles `source` with: the tile constants shared with `tiling.py`."""
    return (f"-DACC_CAPACITY={ACC_CAPACITY}", f"-DTHREADS={THREADS}")


@cache
def _kernel() -> Kernel:
    from tendril.cuda.nvrtc import compile_kernel

    return compile_kernel(source(), KERNEL_NAME, options=compile_options())


def conv(
    acts: CompressedActivations,
    weights: SparseConvWeights,
    tiled: TiledWeights,
    init: torch.Tensor,
    *,
    relu: bool = False,
) -> torch.Tensor:
    """`init + conv(acts, weights)` (then ReLU if asked), computed in place in `init` and returned."""
    g = weights.geometry
    layout = acts.layout
    tiles = tiled.plan
    if layout.virtual_channels != g.virtual_channels or layout.plane_hw != g.plane_hw:
        raise ValueError("activations were compressed for a different convolution geometry")
    if tuple(init.shape) != (g.out_channels, *g.out_hw) or init.dtype != torch.float32 or not init.is_contiguous():
        raise ValueError(f"init must be a contiguous float32 {[g.out_channels, *g.out_hw]} tensor")
    if acts.values.dtype != torch.float32 or weights.values.dtype != torch.float32:
        raise ValueError(
            f"the cuda kernel is fp32 only, got {weights.values.dtype} weights and {acts.values.dtype} activations"
        )
    if tiles.k_block * tiles.tile_h * g.out_hw[1] > ACC_CAPACITY:
        raise ValueError(f"tile {tiles} does not fit {ACC_CAPACITY} shared-memory accumulators")
    if tiled.row_ptr.shape != (g.virtual_channels, tiled.n_blocks * tiled.kernel_h + 1):
        raise ValueError("the tiled weights were prepared for a different geometry")
    if weights.nnz == 0:
        return init.relu_() if relu else init
    i32 = ctypes.c_int32
    _kernel().launch(
        tiles.grid(g),
        THREADS,
        [
            init,
            acts.values,
            acts.positions,
            acts.row_ptr,
            tiled.values,
            tiled.taps,
            tiled.row_ptr,
            i32(g.virtual_channels),
            i32(layout.capacity),
            i32(layout.plane_hw[0]),
            i32(layout.plane_hw[1]),
            i32(g.out_channels),
            i32(g.out_hw[0]),
            i32(g.out_hw[1]),
            i32(tiled.kernel_h),
            i32(tiles.tile_h),
            i32(tiles.k_block),
            i32(tiled.n_blocks),
            i32(tiles.act_lanes),
            i32(int(relu)),
        ],
    )
    return init
