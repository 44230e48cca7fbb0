// Level 4: two consumer warpgroups. Level 3's ring with a 128 x 128 tile of C: warpgroup w (threads
// 128w .. 128w + 127) multiplies rows 64w .. 64w + 63 of each slice of A by the whole slice of B, so a slice
// of B, copied once, feeds twice the products, and each stage's "empty" barrier waits for both warpgroups.
// The producer warp is threads 256-287.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 128;
constexpr int CONSUMERS = 2;
constexpr int STAGES = 4;
constexpr int A_SLICE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int STAGE_BYTES = A_SLICE_BYTES + B_SLICE_BYTES;
constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;
static_assert(SHARED_BYTES <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

extern "C" __global__ void __launch_bounds__(288) hopper_level4(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];   // full[STAGES], then empty[STAGES]
    const unsigned stage0 = aligned_1024(shared), full0 = shared_address(barriers), empty0 = full0 + 8 * STAGES;
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N, slices = K / SLICE_K;
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    if (threadIdx.x == 0) init_ring<STAGES>(full0, empty0, CONSUMERS);   // one arrival from each consumer warpgroup
    __syncthreads();
    if (warpgroup == CONSUMERS) {   // the producer warp
        if (thread == 0)
            for (int slice = 0; slice < slices; ++slice) {
                const int stage = slice % STAGES, round = slice / STAGES;
                const unsigned a_tile = stage0 + stage * STAGE_BYTES;
                mbarrier_wait(empty0 + 8 * stage, round % 2 ^ 1);
                tma_load_slice(a_tile, a_tile + A_SLICE_BYTES, a_map, b_map, BLOCK_M, row0, column0, slice,
                           full0 + 8 * stage);
            }
        return;
    }
    float d[ACCUMULATORS];
    clear_accumulators(d);
    for (int slice = 0; slice < slices; ++slice) {
        const int stage = slice % STAGES, round = slice / STAGES;
        const unsigned a_tile = stage0 + stage * STAGE_BYTES;
        mbarrier_wait(full0 + 8 * stage, round % 2);
        wgmma_slice(d, a_tile + warpgroup * 64 * ROW_BYTES, a_tile + A_SLICE_BYTES);   // its 64 rows of A
        wgmma_wait_group<0>();
        fence_accumulators(d);
        if (thread == 0) mbarrier_arrive(empty0 + 8 * stage);
    }
    store_accumulators(c, N, row0 + 64 * warpgroup, column0, thread, d);
}
