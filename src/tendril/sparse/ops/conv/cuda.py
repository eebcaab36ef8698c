"""Sparse×sparse convolution in CUDA C++ (NVRTC): SCNN's Cartesian product into shared-memory tiles.

The Triton kernel (`triton.py`) must scatter every product into global memory with an atomic, so it
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
by `cuda_emulation.py`, which CI checks against the reference.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import TYPE_CHECKING

import torch

from tendril.sparse.format import CompressedActivations, SparseConvWeights
from tendril.sparse.ops.conv.tiling import ACC_CAPACITY, THREADS, TiledWeights

if TYPE_CHECKING:
    from tendril.cuda.nvrtc import Kernel

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(THREADS)
scnn_conv_tiled(float* __restrict__ out, const float* __restrict__ act_values,
                const int* __restrict__ act_positions, const int* __restrict__ act_row_ptr,
                const float* __restrict__ w_values, const int* __restrict__ w_taps,
                const int* __restrict__ w_row_ptr, int virtual_channels, int capacity, int plane_h,
                int plane_w, int out_channels, int out_h, int out_w, int kernel_h, int tile_h,
                int k_block, int n_blocks, int act_lanes, int relu)
{
    __shared__ float acc[ACC_CAPACITY];
    __shared__ int4 slices[THREADS];
    const int oy0 = blockIdx.x * tile_h;
    const int kb = blockIdx.y;
    const int k0 = kb * k_block;
    const int rows = min(tile_h, out_h - oy0);
    const int k_count = min(k_block, out_channels - k0);
    const int tile_size = rows * out_w;
    const long plane_out = (long)out_h * out_w;
    float* tile_out = out + (long)k0 * plane_out + (long)oy0 * out_w;
    for (int i = threadIdx.x; i < k_count * tile_size; i += THREADS) {
        const int kk = i / tile_size;
        acc[i] = tile_out[kk * plane_out + (i - kk * tile_size)];
    }
    __syncthreads();
    const int band_begin = oy0;
    const int band_end = min(plane_h, oy0 + rows + kernel_h - 1);
    const int warp = threadIdx.x / 32;
    const int a_lane = threadIdx.x % 32 % act_lanes;
    const int w_lane = threadIdx.x % 32 / act_lanes;
    const int w_lanes = 32 / act_lanes;
    for (int v0 = 0; v0 < virtual_channels; v0 += THREADS) {
        // Stage the slices of the next THREADS channels: (weights begin, end, band begin, end).
        const int chunk = min(THREADS, virtual_channels - v0);
        __syncthreads();
        if (threadIdx.x < chunk) {
            const int v = v0 + threadIdx.x;
            const int* rp = act_row_ptr + (long)v * (plane_h + 1);
            const int* wp = w_row_ptr + (long)v * (n_blocks * kernel_h + 1) + kb * kernel_h;
            slices[threadIdx.x] = make_int4(__ldg(wp), __ldg(wp + kernel_h),
                                            min(__ldg(rp + band_begin), capacity),
                                            min(__ldg(rp + band_end), capacity));
        }
        __syncthreads();
        for (int c = warp; c < chunk; c += THREADS / 32) {  // one channel per warp at a time
            const int4 slice = slices[c];
            if (slice.x == slice.y || slice.z == slice.w) continue;
            const int* wp = w_row_ptr + (long)(v0 + c) * (n_blocks * kernel_h + 1) + kb * kernel_h;
            const float* values = act_values + (long)(v0 + c) * capacity;
            const int* positions = act_positions + (long)(v0 + c) * capacity;
            for (int j = slice.z + a_lane; j < slice.w; j += act_lanes) {
                const float a = __ldg(values + j);
                const int flat = __ldg(positions + j);
                const int iy = flat / plane_w;
                const int ty = iy - oy0;
                const int ix = flat - iy * plane_w;
                // Only the kernel rows r' with 0 <= ty - r' < rows land in this tile.
                const int r_lo = max(0, ty - rows + 1);
                const int r_hi = min(kernel_h - 1, ty);
                if (r_lo > r_hi) continue;
                const int i_end = __ldg(wp + r_hi + 1);
                for (int i = __ldg(wp + r_lo) + w_lane; i < i_end; i += w_lanes) {
                    const int tap = __ldg(w_taps + i);
                    const int oy = ty - ((tap >> 8) & 0xFF);
                    const int ox = ix - (tap & 0xFF);
                    if (ox >= 0 && ox < out_w) {
                        atomicAdd(&acc[((tap >> 16) - k0) * tile_size + oy * out_w + ox], __ldg(w_values + i) * a);
                    }
                }
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < k_count * tile_size; i += THREADS) {
        const int kk = i / tile_size;
        const float y = acc[i];
        tile_out[kk * plane_out + (i - kk * tile_size)] = relu ? fmaxf(y, 0.0f) : y;
    }
}
"""


@cache
def _kernel() -> Kernel:
    from tendril.cuda.nvrtc import compile_kernel

    options = (f"-DACC_CAPACITY={ACC_CAPACITY}", f"-DTHREADS={THREADS}")
    return compile_kernel(SOURCE, "scnn_conv_tiled", options=options)


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
