"""CUDA C++ of the register-tiled convolution's pixel-run kernel (1×1 convolutions), the `PIXEL_RUN` branch of
`register_source.SOURCE`.

1×1 convolutions (ResNet's bottleneck reduce/expand and downsample layers) are sparse × dense matrix
products; their pixel-run plans compile this kernel of the same source (same arguments, buffers, splits,
tickets and epilogue): a block stages `32 × pw` flattened output pixels per input channel (16-byte
`cp.async` copies at stride 1 when the input is aligned, gathered 4-byte ones when strided), a warp reads
one record per channel (its `kt` output channels' mask, skipping the channel when it is empty), each lane
loads its `pw` pixels as `pw / vector` conflict-free vectors, and each nonzero weight is one broadcast
load and `pw` FMAs; outputs leave as coalesced vector stores.
"""

PIXEL_RUN_SOURCE = r"""
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
"""
