
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
