
#define K_BLOCK (WARPS * KT)
#define THREADS (WARPS * 32)

__device__ __forceinline__ void copy4_async(void* dst, const void* src, bool valid) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(src), "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void commit_async() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void wait_async_all_but_last() { asm volatile("cp.async.wait_group 1;\n" ::); }
#if PIXEL_RUN

// Pixel runs (register_tiling.py): a block owns RUN flattened output pixels; lane l owns PW / VEC groups
// of VEC adjacent pixels, group g at g * 32 * VEC + l * VEC of the run (conflict-free vector loads from
// shared memory, coalesced vector stores). One record per (k-block, channel, warp): bit kk says weight
// (k0 + warp * KT + kk, c) is nonzero; bits 16+ are the offset of the warp's values in the channel's.
#define RUN (32 * PW)
#define LANE_GROUPS (PW / VEC)
#define RUN_RECORDS (C_CHUNK * WARPS)

__device__ __forceinline__ void copy16_async(void* dst, const void* src, int bytes) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(src), "r"(bytes));
}

// VEC floats from a VEC-aligned shared address into dst[o, o + VEC).
__device__ __forceinline__ void load_group(float (&dst)[PW], int o, const float* src) {
#if VEC == 4
    const float4 v = *reinterpret_cast<const float4*>(src);
    dst[o] = v.x; dst[o + 1] = v.y; dst[o + 2] = v.z; dst[o + 3] = v.w;
#elif VEC == 2
    const float2 v = *reinterpret_cast<const float2*>(src);
    dst[o] = v.x; dst[o + 1] = v.y;
#else
    dst[o] = *src;
#endif
}

// y[0, VEC) += residual[0, VEC) read from a VEC-aligned global address, through the read-only path.
__device__ __forceinline__ void add_residual_group(float (&y)[VEC], const float* src) {
#if VEC == 4
    const float4 v = __ldg(reinterpret_cast<const float4*>(src));
    y[0] += v.x; y[1] += v.y; y[2] += v.z; y[3] += v.w;
#elif VEC == 2
    const float2 v = __ldg(reinterpret_cast<const float2*>(src));
    y[0] += v.x; y[1] += v.y;
#else
    y[0] += __ldg(src);
#endif
}

__device__ __forceinline__ void store_group(float* dst, const float (&y)[VEC]) {
#if VEC == 4
    *reinterpret_cast<float4*>(dst) = make_float4(y[0], y[1], y[2], y[3]);
#elif VEC == 2
    *reinterpret_cast<float2*>(dst) = make_float2(y[0], y[1]);
#else
    dst[0] = y[0];
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
sparse_weight_conv(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ bias,
                   const float* __restrict__ residual, const float* __restrict__ w_values,
                   const unsigned* __restrict__ w_records, const int* __restrict__ w_chan_ptr,
                   float* __restrict__ workspace, int* __restrict__ tickets, int* __restrict__ counts,
                   int in_h, int in_w, int out_h, int out_w, int out_channels, int group_in, int group_out,
                   int k_blocks_per_group, int tiles_x, int split_channels, int relu, int has_residual)
{
    __shared__ __align__(16) float act[2][C_CHUNK * RUN];
    __shared__ __align__(16) unsigned rec[2][RUN_RECORDS];
    __shared__ float vals[2][VAL_CAP];
    __shared__ int chan_start[CHAN_CAP];
    __shared__ int shared_int;

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int in_plane = in_h * in_w;
    const int out_plane = out_h * out_w;
    const int p0 = blockIdx.x * RUN;
    const int kb = blockIdx.y;
    const int group = kb / k_blocks_per_group;
    const int k_local0 = (kb - group * k_blocks_per_group) * K_BLOCK;
    const int k0 = group * group_out + k_local0;
    const int k_count = min(K_BLOCK, group_out - k_local0);
    const int split = blockIdx.z;
    const int splits = gridDim.z;
    const int c_begin = split * split_channels;
    const int c_end = min(group_in, c_begin + split_channels);
    const float* x_group = x + (long)group * group_in * in_plane;
    // At stride 1 a channel's run is contiguous in the input (in_plane == out_plane): 16-byte copies where aligned.
    const bool copy16 = SH == 1 && SW == 1 && in_plane % 4 == 0 && (reinterpret_cast<size_t>(x_group) & 15) == 0;

    for (int i = threadIdx.x; i <= c_end - c_begin; i += THREADS)
        chan_start[i] = __ldg(w_chan_ptr + (long)kb * (group_in + 1) + c_begin + i);
    __syncthreads();

    // Issue (not wait for) the copies of channels [c0, c0 + C_CHUNK) into buffer `buf`, zeros past the plane.
    auto stage = [&](int c0, int buf) {
        const int chunk = min(C_CHUNK, c_end - c0);
        if (copy16) {
            for (int i = threadIdx.x; i < chunk * (RUN / 4); i += THREADS) {
                const int cc = i / (RUN / 4);
                const int q = 4 * (i - cc * (RUN / 4));
                const int bytes = 4 * max(0, min(4, out_plane - (p0 + q)));
                const float* src = x_group + (long)(c0 + cc) * in_plane + (bytes > 0 ? p0 + q : 0);
                copy16_async(act[buf] + cc * RUN + q, src, bytes);
            }
        } else {  // strided (or unaligned): gather one float per copy
            for (int i = threadIdx.x; i < chunk * RUN; i += THREADS) {
                const int cc = i / RUN;
                const int q = i - cc * RUN;
                const int p = p0 + q;
                const bool inside = p < out_plane;
                const int oy = p / out_w;
                const int ox = p - oy * out_w;
                const float* src = x_group + (long)(c0 + cc) * in_plane + (long)oy * SH * in_w + ox * SW;
                copy4_async(act[buf] + cc * RUN + q, inside ? src : x, inside);
            }
        }
        const unsigned* rec_src = w_records + ((long)kb * group_in + c0) * WARPS;
        for (int i = threadIdx.x; i < chunk * WARPS; i += THREADS) copy4_async(&rec[buf][i], rec_src + i, true);
        const int v_begin = chan_start[c0 - c_begin];
        const int v_count = chan_start[c0 - c_begin + chunk] - v_begin;
        for (int i = threadIdx.x; i < v_count; i += THREADS) copy4_async(&vals[buf][i], w_values + v_begin + i, true);
    };

    float acc[KT][PW];
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
#pragma unroll
        for (int j = 0; j < PW; ++j) acc[kk][j] = 0.0f;

    const int chunks = c_end > c_begin ? (c_end - c_begin + C_CHUNK - 1) / C_CHUNK : 0;
    if (chunks > 0) stage(c_begin, 0);
    commit_async();
    for (int n = 0; n < chunks; ++n) {
        const int buf = n & 1;
        const int c0 = c_begin + n * C_CHUNK;
        if (n + 1 < chunks) stage(c0 + C_CHUNK, buf ^ 1);
        commit_async();
        wait_async_all_but_last();  // this thread's copies of chunk n have landed
        __syncthreads();            // and every thread's

        const int chunk = min(C_CHUNK, c_end - c0);
        const int v_begin = chan_start[c0 - c_begin];
#pragma unroll 1
        for (int cc = 0; cc < chunk; ++cc) {
            // The same record in every lane; reduced so that the compiler knows it (uniform branches).
            const unsigned m = __reduce_or_sync(0xffffffffu, rec[buf][cc * WARPS + warp]);
            if ((m & 0xffffu) == 0) continue;  // none of the warp's output channels reads this channel
            const float* a = act[buf] + cc * RUN + lane * VEC;
            float win[PW];
#pragma unroll
            for (int g = 0; g < LANE_GROUPS; ++g) load_group(win, g * VEC, a + g * 32 * VEC);
            const float* w = vals[buf] + (chan_start[c0 - c_begin + cc] - v_begin) + (m >> 16);
#pragma unroll
            for (int kk = 0; kk < KT; ++kk) {
                if (m & (1u << kk)) {
                    const float weight = *w++;
#pragma unroll
                    for (int j = 0; j < PW; ++j) acc[kk][j] = fmaf(weight, win[j], acc[kk][j]);
                }
            }
        }
        __syncthreads();  // every reader of `buf` is done before chunk n + 2 is staged into it
    }

    // Nonzero inputs of this run's 1 / gridDim.x share of the flattened input plane (first k-block of each group).
    if (counts != nullptr && kb == group * k_blocks_per_group) {
        const int share = (in_plane + (int)gridDim.x - 1) / (int)gridDim.x;
        const int lo = min((int)blockIdx.x * share, in_plane);
        const int n = min(lo + share, in_plane) - lo;
        int found = 0;
        for (int i = threadIdx.x; i < (c_end - c_begin) * n; i += THREADS) {
            const int c = i / n;
            found += __ldg(x_group + (long)(c_begin + c) * in_plane + lo + i - c * n) != 0.0f;
        }
        if (threadIdx.x == 0) shared_int = 0;
        __syncthreads();
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) found += __shfl_down_sync(0xffffffffu, found, offset);
        if (lane == 0) atomicAdd(&shared_int, found);
        __syncthreads();
        if (threadIdx.x == 0) counts[((long)group * splits + split) * gridDim.x + blockIdx.x] = shared_int;
    }

    const long plane = out_plane;
    if (splits > 1) {
        float* partial = workspace + (long)split * out_channels * plane;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            const int kl = warp * KT + kk;
            if (kl >= k_count) continue;
#pragma unroll
            for (int j = 0; j < PW; ++j) {
                const int p = p0 + (j / VEC) * 32 * VEC + lane * VEC + j % VEC;
                if (p < out_plane) partial[(k0 + kl) * plane + p] = acc[kk][j];
            }
        }
        __threadfence();
        __syncthreads();
        int* ticket = tickets + (long)blockIdx.y * gridDim.x + blockIdx.x;
        if (threadIdx.x == 0) shared_int = atomicAdd(ticket, 1);
        __syncthreads();
        if (shared_int != splits - 1) return;  // not the last split of this run to finish
        __threadfence();
        if (threadIdx.x == 0) *ticket = 0;  // ready for the next launch (graph replays included)
        // The last block adds the partials in split order (deterministic), coalesced along the run.
        const int count = min(RUN, out_plane - p0);
        for (int i = threadIdx.x; i < k_count * count; i += THREADS) {
            const int kl = i / count;
            const long index = (k0 + kl) * plane + p0 + i - kl * count;
            float sum = 0.0f;
            for (int z = 0; z < splits; ++z) sum += __ldcg(workspace + z * out_channels * plane + index);
            float y = sum + __ldg(bias + k0 + kl);
            if (has_residual) y += __ldg(residual + index);
            out[index] = relu ? fmaxf(y, 0.0f) : y;
        }
        return;
    }
    // A group lies wholly inside the plane or wholly outside when the plane is a multiple of VEC.
    const bool vector_out = VEC > 1 && out_plane % VEC == 0 && (reinterpret_cast<size_t>(out) & (4 * VEC - 1)) == 0 &&
                            (!has_residual || (reinterpret_cast<size_t>(residual) & (4 * VEC - 1)) == 0);
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        const int kl = warp * KT + kk;
        if (kl >= k_count) continue;
        const int k = k0 + kl;
        const float b = __ldg(bias + k);
#pragma unroll
        for (int g = 0; g < LANE_GROUPS; ++g) {
            const int p = p0 + g * 32 * VEC + lane * VEC;
            const long index = k * plane + p;
            float y[VEC];
#pragma unroll
            for (int v = 0; v < VEC; ++v) y[v] = acc[kk][g * VEC + v] + b;
            if (vector_out) {
                if (p >= out_plane) continue;
                if (has_residual) add_residual_group(y, residual + index);
#pragma unroll
                for (int v = 0; v < VEC; ++v) y[v] = relu ? fmaxf(y[v], 0.0f) : y[v];
                store_group(out + index, y);
            } else {
#pragma unroll
                for (int v = 0; v < VEC; ++v) {
                    if (p + v >= out_plane) continue;
                    float t = y[v];
                    if (has_residual) t += __ldg(residual + index + v);
                    out[index + v] = relu ? fmaxf(t, 0.0f) : t;
                }
            }
        }
    }
}
#else

#define TILE_H (LANES_Y * PH)
#define TILE_W (LANES_X * PW)
#define ACTIVE_LANES (LANES_X * LANES_Y)
#define WIN_H ((PH - 1) * SH + R)
#define WIN_W ((PW - 1) * SW + S)
#define CHAN_FLOATS (IN_H * PITCH)
#define ACT_FLOATS (C_CHUNK * CHAN_FLOATS)
#define GROUPS (R / RECORD_ROWS)  // row groups: one record per (k, c, group) covers RECORD_ROWS × S taps
#define RECORDS (C_CHUNK * GROUPS * K_BLOCK)

// The first row group whose pass reads window row q (i * SH + r == q), -1 when none does.
__device__ constexpr int first_use(int q) {
    for (int r = 0; r < R; ++r)
        for (int i = 0; i < PH; ++i)
            if (i * SH + r == q) return r / RECORD_ROWS;
    return -1;
}

// One window row: WIN_W floats from a VEC-aligned shared address, widest vectors first.
__device__ __forceinline__ void load_row(float (&dst)[WIN_W], const float* src) {
    constexpr int N4 = VEC >= 4 ? WIN_W / 4 : 0;
    constexpr int B2 = 4 * N4;
    constexpr int N2 = VEC >= 2 ? (WIN_W - B2) / 2 : 0;
#pragma unroll
    for (int t = 0; t < N4; ++t) {
        const float4 v = *reinterpret_cast<const float4*>(src + 4 * t);
        dst[4 * t] = v.x; dst[4 * t + 1] = v.y; dst[4 * t + 2] = v.z; dst[4 * t + 3] = v.w;
    }
#pragma unroll
    for (int t = 0; t < N2; ++t) {
        const float2 v = *reinterpret_cast<const float2*>(src + B2 + 2 * t);
        dst[B2 + 2 * t] = v.x; dst[B2 + 2 * t + 1] = v.y;
    }
#pragma unroll
    for (int j = B2 + 2 * N2; j < WIN_W; ++j) dst[j] = src[j];
}

// A warp's KT records of one row group (adjacent, aligned to KT words when KT is 2 or 4).
__device__ __forceinline__ void load_records(unsigned (&dst)[KT], const unsigned* src) {
#if KT == 4
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
#elif KT == 2
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    dst[0] = v.x; dst[1] = v.y;
#else
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) dst[kk] = src[kk];
#endif
}

extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)
sparse_weight_conv(float* __restrict__ out, const float* __restrict__ x, const float* __restrict__ bias,
                   const float* __restrict__ residual, const float* __restrict__ w_values,
                   const unsigned* __restrict__ w_records, const int* __restrict__ w_chan_ptr,
                   float* __restrict__ workspace, int* __restrict__ tickets, int* __restrict__ counts,
                   int in_h, int in_w, int out_h, int out_w, int out_channels, int group_in, int group_out,
                   int k_blocks_per_group, int tiles_x, int split_channels, int relu, int has_residual)
{
    __shared__ __align__(16) float act[2][ACT_FLOATS];
    __shared__ __align__(16) unsigned rec[2][RECORDS];
    __shared__ float vals[2][VAL_CAP];
    __shared__ int chan_start[CHAN_CAP];
    __shared__ int shared_int;

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const bool lane_active = lane < ACTIVE_LANES;
    const int lx = min(lane, ACTIVE_LANES - 1) % LANES_X;  // an idle lane reads what the last active lane reads
    const int ly = min(lane, ACTIVE_LANES - 1) / LANES_X;  // (the same addresses: broadcast) and writes nothing
    const int tiles_y = gridDim.x / tiles_x;
    const int tile_y = blockIdx.x / tiles_x;
    const int tile_x = blockIdx.x - tile_y * tiles_x;
    const int oy0 = tile_y * TILE_H;
    const int ox0 = tile_x * TILE_W;
    const int iy0 = oy0 * SH - PADH;
    const int ix0 = ox0 * SW - PADW;
    const int kb = blockIdx.y;
    const int group = kb / k_blocks_per_group;
    const int k_local0 = (kb - group * k_blocks_per_group) * K_BLOCK;
    const int k0 = group * group_out + k_local0;
    const int k_count = min(K_BLOCK, group_out - k_local0);
    const int split = blockIdx.z;
    const int splits = gridDim.z;
    const int c_begin = split * split_channels;
    const int c_end = min(group_in, c_begin + split_channels);
    const float* x_group = x + (long)group * group_in * in_h * in_w;
    const int lane_offset = ly * PH * SH * PITCH + lx * PW * SW;

    for (int i = threadIdx.x; i <= c_end - c_begin; i += THREADS)
        chan_start[i] = __ldg(w_chan_ptr + (long)kb * (group_in + 1) + c_begin + i);
    __syncthreads();

    // Issue (not wait for) the copies of channels [c0, c0 + C_CHUNK) into buffer `buf`.
    auto stage = [&](int c0, int buf) {
        const int chunk = min(C_CHUNK, c_end - c0);
        for (int row = warp; row < chunk * IN_H; row += WARPS) {  // a warp per staged row: coalesced
            const int cc = row / IN_H;
            const int y = row - cc * IN_H;
            const int iy = iy0 + y;
            const bool row_inside = iy >= 0 && iy < in_h;
            const float* src = x_group + ((long)(c0 + cc) * in_h + (row_inside ? iy : 0)) * in_w;
            float* dst = act[buf] + cc * CHAN_FLOATS + y * PITCH;
            for (int xx = lane; xx < IN_W; xx += 32) {
                const int ix = ix0 + xx;
                const bool inside = row_inside && ix >= 0 && ix < in_w;
                copy4_async(dst + xx, inside ? src + ix : x, inside);  // zero-filled outside the input
            }
        }
        const unsigned* rec_src = w_records + ((long)kb * group_in + c0) * (GROUPS * K_BLOCK);
        for (int i = threadIdx.x; i < chunk * GROUPS * K_BLOCK; i += THREADS)
            copy4_async(&rec[buf][i], rec_src + i, true);
        const int v_begin = chan_start[c0 - c_begin];
        const int v_count = chan_start[c0 - c_begin + chunk] - v_begin;
        for (int i = threadIdx.x; i < v_count; i += THREADS) copy4_async(&vals[buf][i], w_values + v_begin + i, true);
    };

    float acc[KT][PH][PW];
#pragma unroll
    for (int kk = 0; kk < KT; ++kk)
#pragma unroll
        for (int i = 0; i < PH; ++i)
#pragma unroll
            for (int j = 0; j < PW; ++j) acc[kk][i][j] = 0.0f;

    const int chunks = c_end > c_begin ? (c_end - c_begin + C_CHUNK - 1) / C_CHUNK : 0;
    if (chunks > 0) stage(c_begin, 0);
    commit_async();
    for (int n = 0; n < chunks; ++n) {
        const int buf = n & 1;
        const int c0 = c_begin + n * C_CHUNK;
        if (n + 1 < chunks) stage(c0 + C_CHUNK, buf ^ 1);
        commit_async();
        wait_async_all_but_last();  // this thread's copies of chunk n have landed
        __syncthreads();            // and every thread's

        const int chunk = min(C_CHUNK, c_end - c0);
        const int v_begin = chan_start[c0 - c_begin];
#pragma unroll 1
        for (int cc = 0; cc < chunk; ++cc) {
            const float* a = act[buf] + cc * CHAN_FLOATS + lane_offset;
            const unsigned* records = rec[buf] + cc * GROUPS * K_BLOCK + warp * KT;
            const float* values = vals[buf] + (chan_start[c0 - c_begin + cc] - v_begin);
            float win[WIN_H][WIN_W];
#pragma unroll
            for (int rg = 0; rg < GROUPS; ++rg) {
#pragma unroll
                for (int q = 0; q < WIN_H; ++q)
                    if (first_use(q) == rg) load_row(win[q], a + q * PITCH);
                unsigned record[KT];
                load_records(record, records + rg * K_BLOCK);
#pragma unroll
                for (int kk = 0; kk < KT; ++kk) {
                    // The same value in every lane; reduced so that the compiler knows it (uniform
                    // registers and branches, no reconvergence barriers around each tap).
                    const unsigned m = __reduce_or_sync(0xffffffffu, record[kk]);
                    const float* w = values + (m >> 16);
#pragma unroll
                    for (int t = 0; t < RECORD_ROWS * S; ++t) {
                        if (m & (1u << t)) {
                            const int r = rg * RECORD_ROWS + t / S;
                            const int s = t % S;
                            const float weight = *w++;
#pragma unroll
                            for (int i = 0; i < PH; ++i)
#pragma unroll
                                for (int j = 0; j < PW; ++j)
                                    acc[kk][i][j] = fmaf(weight, win[i * SH + r][j * SW + s], acc[kk][i][j]);
                        }
                    }
                }
            }
        }
        __syncthreads();  // every reader of `buf` is done before chunk n + 2 is staged into it
    }

    // Nonzero inputs of this tile's share of the plane (the first k-block of each group counts).
    if (counts != nullptr && kb == group * k_blocks_per_group) {
        const int y_lo = tile_y == 0 ? 0 : min(max(iy0, 0), in_h);
        const int y_hi = tile_y == tiles_y - 1 ? in_h : min(max(iy0 + TILE_H * SH, 0), in_h);
        const int x_lo = tile_x == 0 ? 0 : min(max(ix0, 0), in_w);
        const int x_hi = tile_x == tiles_x - 1 ? in_w : min(max(ix0 + TILE_W * SW, 0), in_w);
        const int h = y_hi - y_lo;
        const int w = x_hi - x_lo;
        int found = 0;
        for (int i = threadIdx.x; i < (c_end - c_begin) * h * w; i += THREADS) {
            const int c = i / (h * w);
            const int rest = i - c * (h * w);
            const int y = rest / w;
            found += __ldg(x_group + ((long)(c_begin + c) * in_h + y_lo + y) * in_w + x_lo + rest - y * w) != 0.0f;
        }
        if (threadIdx.x == 0) shared_int = 0;
        __syncthreads();
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2) found += __shfl_down_sync(0xffffffffu, found, offset);
        if (lane == 0) atomicAdd(&shared_int, found);
        __syncthreads();
        if (threadIdx.x == 0) counts[((long)group * splits + split) * gridDim.x + blockIdx.x] = shared_int;
    }

    const long plane = (long)out_h * out_w;
    if (splits > 1) {
        float* partial = workspace + (long)split * out_channels * plane;
#pragma unroll
        for (int kk = 0; kk < KT; ++kk) {
            const int kl = warp * KT + kk;
            if (kl >= k_count || !lane_active) continue;
#pragma unroll
            for (int i = 0; i < PH; ++i) {
                const int oy = oy0 + ly * PH + i;
#pragma unroll
                for (int j = 0; j < PW; ++j) {
                    const int ox = ox0 + lx * PW + j;
                    if (oy < out_h && ox < out_w) partial[(k0 + kl) * plane + (long)oy * out_w + ox] = acc[kk][i][j];
                }
            }
        }
        __threadfence();
        __syncthreads();
        int* ticket = tickets + (long)blockIdx.y * gridDim.x + blockIdx.x;
        if (threadIdx.x == 0) shared_int = atomicAdd(ticket, 1);
        __syncthreads();
        if (shared_int != splits - 1) return;  // not the last split of this tile to finish
        __threadfence();
        if (threadIdx.x == 0) *ticket = 0;  // ready for the next launch (graph replays included)
        // The last block adds the partials in split order (deterministic), coalesced along x.
        const int rows = min(TILE_H, out_h - oy0);
        const int cols = min(TILE_W, out_w - ox0);
        for (int i = threadIdx.x; i < k_count * rows * cols; i += THREADS) {
            const int kl = i / (rows * cols);
            const int rest = i - kl * (rows * cols);
            const int oy = oy0 + rest / cols;
            const int ox = ox0 + rest % cols;
            const long index = (k0 + kl) * plane + (long)oy * out_w + ox;
            float sum = 0.0f;
            for (int z = 0; z < splits; ++z) sum += __ldcg(workspace + z * out_channels * plane + index);
            float y = sum + __ldg(bias + k0 + kl);
            if (has_residual) y += __ldg(residual + index);
            out[index] = relu ? fmaxf(y, 0.0f) : y;
        }
        return;
    }
#pragma unroll
    for (int kk = 0; kk < KT; ++kk) {
        const int kl = warp * KT + kk;
        if (kl >= k_count || !lane_active) continue;
        const int k = k0 + kl;
        const float b = __ldg(bias + k);
#pragma unroll
        for (int i = 0; i < PH; ++i) {
            const int oy = oy0 + ly * PH + i;
#pragma unroll
            for (int j = 0; j < PW; ++j) {
                const int ox = ox0 + lx * PW + j;
                if (oy >= out_h || ox >= out_w) continue;
                const long index = k * plane + (long)oy * out_w + ox;
                float y = acc[kk][i][j] + b;
                if (has_residual) y += __ldg(residual + index);
                out[index] = relu ? fmaxf(y, 0.0f) : y;
            }
        }
    }
}
#endif
