// Level 3: a producer warp and a full/empty ring. The block is one consumer warpgroup (threads 0-127, a
// 64 x 128 tile of C) and one producer warp (threads 128-159), of which one thread issues every copy. The
// ring has STAGES slices, each with two mbarriers: "full" completes when the slice's bytes have landed,
// "empty" when the consumers are done reading it. Slice s lives in stage s % STAGES in round s / STAGES:
// the consumers wait for full's phase of parity round % 2; the producer, before refilling a stage, for the
// previous round's empty phase, parity (round - 1) % 2 = (round % 2) ^ 1, which on a fresh barrier (round 0)
// returns at once. No __syncthreads in the loop: the producer runs up to STAGES slices ahead.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 64;
constexpr int STAGES = 4;
constexpr int A_SLICE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int STAGE_BYTES = A_SLICE_BYTES + B_SLICE_BYTES;
constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;
static_assert(SHARED_BYTES <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

extern "C" __global__ void __launch_bounds__(160) hopper_level3(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];   // full[STAGES], then empty[STAGES]
    const unsigned stage0 = aligned_1024(shared), full0 = shared_address(barriers), empty0 = full0 + 8 * STAGES;
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N, slices = K / SLICE_K;
    if (threadIdx.x == 0) init_ring<STAGES>(full0, empty0, 1);   // one arrival from the consumer warpgroup
    __syncthreads();
    if (threadIdx.x >= 128) {   // the producer warp
        if (threadIdx.x == 128)
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
        wgmma_slice(d, a_tile, a_tile + A_SLICE_BYTES);
        wgmma_wait_group<0>();
        fence_accumulators(d);
        if (threadIdx.x == 0) mbarrier_arrive(empty0 + 8 * stage);   // the stage may be filled again
    }
    store_accumulators(c, N, row0, column0, threadIdx.x, d);
}
