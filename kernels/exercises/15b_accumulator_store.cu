#include "hopper_levels.cuh"

constexpr int BLOCK_M = 64;
constexpr int THREADS = 128;
constexpr int A_SLICE_BYTES = BLOCK_M * ROW_BYTES;

// Level 1 for any M (N a multiple of 128, K of 64): rows of A past M copy as zeros, and the warpgroup's
// 64 x 128 accumulator goes to C row by row, skipping rows past M.
extern "C" __global__ void wgmma_tile_store(float* C, const __nv_bfloat16* A,
                                            const __nv_bfloat16* B, int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N;
    const unsigned a_tile = aligned_1024(shared), b_tile = a_tile + A_SLICE_BYTES;
    float d[ACCUMULATORS];
    clear_accumulators(d);
    for (int k0 = 0; k0 < K; k0 += SLICE_K) {
        copy_slice_swizzled<THREADS>(a_tile, A + (long long)row0 * K + k0, BLOCK_M, M - row0, K);
        copy_slice_swizzled<THREADS>(b_tile, B + (long long)column0 * K + k0, BLOCK_N, BLOCK_N, K);
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async_shared();
        __syncthreads();   // every thread's chunks are in
        wgmma_slice(d, a_tile, b_tile);
        wgmma_wait_group<0>();
        fence_accumulators(d);
        __syncthreads();   // no copy overwrites the tiles while a product reads them
    }
    // Warp w holds rows 16w .. 16w + 15; with g = lane / 4, t = lane % 4, d[i] is row 16w + g + 8 ((i / 2) % 2),
    // column 8 (i / 4) + 2t + i % 2: d[i] and d[i + 1] (i even) are neighbours along a row.
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int i = 0; i < ACCUMULATORS; i += 2) {
        const int row = row0 + 16 * warp + g + 8 * (i / 2 % 2), column = column0 + 8 * (i / 4) + 2 * t;
        if (row < M) *reinterpret_cast<float2*>(C + (long long)row * N + column) = make_float2(d[i], d[i + 1]);
    }
}
