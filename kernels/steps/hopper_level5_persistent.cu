// Level 5: persistent blocks and tile order. Level 4's block (two consumer warpgroups, a producer warp, a
// ring of STAGES), launched once per multiprocessor: each block walks the tiles tile, tile + gridDim.x, ...
// in the grouped order of tile_coordinates, and its ring counts on from one tile to the next (`slice`
// numbers every slice the block handles). So while the consumers store one tile's results, the producer
// already fills the stages with the next tile's slices, and no block pays its launch and barrier set-up twice.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 128;
constexpr int CONSUMERS = 2;
constexpr int STAGES = 4;
constexpr int A_SLICE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int STAGE_BYTES = A_SLICE_BYTES + B_SLICE_BYTES;
constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;
static_assert(SHARED_BYTES <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

extern "C" __global__ void __launch_bounds__(288) hopper_level5(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];   // full[STAGES], then empty[STAGES]
    const unsigned stage0 = aligned_1024(shared), full0 = shared_address(barriers), empty0 = full0 + 8 * STAGES;
    const int tiles_m = M / BLOCK_M, tiles_n = N / BLOCK_N, slices = K / SLICE_K;
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    if (threadIdx.x == 0) init_ring<STAGES>(full0, empty0, CONSUMERS);
    __syncthreads();
    int slice = 0;   // this block's slices so far, over all its tiles: the ring's position
    if (warpgroup == CONSUMERS) {   // the producer warp
        if (thread != 0) return;
        for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
            int tile_m, tile_n;
            tile_coordinates(tile, tiles_m, tiles_n, tile_m, tile_n);
            for (int k_slice = 0; k_slice < slices; ++k_slice, ++slice) {
                const int stage = slice % STAGES, round = slice / STAGES;
                const unsigned a_tile = stage0 + stage * STAGE_BYTES;
                mbarrier_wait(empty0 + 8 * stage, round % 2 ^ 1);
                tma_load_slice(a_tile, a_tile + A_SLICE_BYTES, a_map, b_map, BLOCK_M, tile_m * BLOCK_M,
                           tile_n * BLOCK_N, k_slice, full0 + 8 * stage);
            }
        }
        return;
    }
    float d[ACCUMULATORS];
    for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
        int tile_m, tile_n;
        tile_coordinates(tile, tiles_m, tiles_n, tile_m, tile_n);
        clear_accumulators(d);
        for (int k_slice = 0; k_slice < slices; ++k_slice, ++slice) {
            const int stage = slice % STAGES, round = slice / STAGES;
            const unsigned a_tile = stage0 + stage * STAGE_BYTES;
            mbarrier_wait(full0 + 8 * stage, round % 2);
            wgmma_slice(d, a_tile + warpgroup * 64 * ROW_BYTES, a_tile + A_SLICE_BYTES);
            wgmma_wait_group<0>();
            fence_accumulators(d);
            if (thread == 0) mbarrier_arrive(empty0 + 8 * stage);
        }
        store_accumulators(c, N, tile_m * BLOCK_M + 64 * warpgroup, tile_n * BLOCK_N, thread, d);
    }
}
