// Level 1: wgmma from shared memory, fed by cp.async. One warpgroup (128 threads) per 64 x 128 tile of C.
// For each slice of 64 along K every thread copies 16-byte chunks of A's and B's rows into shared memory in
// the 128-byte swizzle the descriptors name (chunk c of row r at chunk c ^ (r % 8)), waits for its copies,
// meets the others at __syncthreads, and the warpgroup issues four wgmma and waits for them before the next
// copies may overwrite the tile. Copy and multiply take turns: the tensor cores idle while memory works.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 64;
constexpr int THREADS = 128;
constexpr int A_SLICE_BYTES = BLOCK_M * ROW_BYTES;                 // 8 KB
constexpr int SHARED_BYTES = A_SLICE_BYTES + B_SLICE_BYTES + 1024;  // and 16 KB of B, from 1024 bytes on
static_assert(SHARED_BYTES <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

extern "C" __global__ void __launch_bounds__(THREADS) hopper_level1(float* c, const __nv_bfloat16* a,
                                                                    const __nv_bfloat16* b, int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N;
    const unsigned a_tile = aligned_1024(shared), b_tile = a_tile + A_SLICE_BYTES;
    float d[ACCUMULATORS];
    clear_accumulators(d);
    for (int k0 = 0; k0 < K; k0 += SLICE_K) {
        copy_slice_swizzled<THREADS>(a_tile, a + (long long)row0 * K + k0, BLOCK_M, BLOCK_M, K);
        copy_slice_swizzled<THREADS>(b_tile, b + (long long)column0 * K + k0, BLOCK_N, BLOCK_N, K);
        cp_async_commit();
        cp_async_wait<0>();
        fence_proxy_async_shared();   // cp.async wrote through the ordinary path; wgmma reads through the async one
        __syncthreads();              // every thread's chunks are in
        wgmma_slice(d, a_tile, b_tile);
        wgmma_wait_group<0>();
        fence_accumulators(d);
        __syncthreads();              // nobody overwrites the tile while a product still reads it
    }
    store_accumulators(c, N, row0, column0, threadIdx.x, d);
}
