#include "hopper_levels.cuh"

constexpr int BLOCK_M = 64;
constexpr int THREADS = 128;
constexpr int A_SLICE_BYTES = BLOCK_M * ROW_BYTES;

// Split K on level 1 (any M, N a multiple of 128, K of 64 * stretches): block z of the grid sums stretch z
// of K only, K / stretches long, and writes its partial sums to its own M x N slab, partials + z M N.
extern "C" __global__ void wgmma_split_k(float* partials, const __nv_bfloat16* A, const __nv_bfloat16* B,
                                         int M, int N, int K, int stretches)
{
    extern __shared__ unsigned char shared[];
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N;
    const int k_begin = blockIdx.z * (K / stretches), k_end = k_begin + K / stretches;   // this block's stretch
    float* C = partials + (long long)blockIdx.z * M * N;                                 // and its slab
    const unsigned a_tile = aligned_1024(shared), b_tile = a_tile + A_SLICE_BYTES;
    float d[ACCUMULATORS];
    clear_accumulators(d);
    for (int k0 = k_begin; k0 < k_end; k0 += SLICE_K) {
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
    // The accumulator's layout (wgmma.cuh), rows past M skipped
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    for (int i = 0; i < ACCUMULATORS; i += 2) {
        const int row = row0 + 16 * warp + g + 8 * (i / 2 % 2), column = column0 + 8 * (i / 4) + 2 * t;
        if (row < M) *reinterpret_cast<float2*>(C + (long long)row * N + column) = make_float2(d[i], d[i + 1]);
    }
}
