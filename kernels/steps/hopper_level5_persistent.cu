// Level 5: persistent blocks and tile order. Level 4's block (two consumer warpgroups, a producer warp, a
// ring of STAGES), launched once per multiprocessor: each block walks the tiles tile, tile + gridDim.x, ...
// in the grouped order of tile_coordinates, and its ring counts on from one tile to the next (`slice`
// numbers every slice the block handles). So while the consumers store one tile's results, the producer
// already fills the stages with the next tile's slices, and no block pays its launch and barrier set-up twice.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 128;
constexpr int CONSUMERS = 2;
constexpr int STAGES = 4;
using SliceRing = Ring<STAGES, BLOCK_M>;

extern "C" __global__ void __launch_bounds__(288) hopper_level5(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];
    const SliceRing ring(shared, barriers);
    const int tiles_m = M / BLOCK_M, tiles_n = N / BLOCK_N, slices = K / SLICE_K;
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    if (threadIdx.x == 0) ring.init(CONSUMERS);
    __syncthreads();
    int slice = 0;   // this block's slices so far, over all its tiles: the ring's position
    if (warpgroup == CONSUMERS) {   // the producer warp
        if (thread != 0) return;
        for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
            int tile_m, tile_n;
            tile_coordinates(tile, tiles_m, tiles_n, tile_m, tile_n);
            for (int k_slice = 0; k_slice < slices; ++k_slice, ++slice)
                ring.produce(slice, a_map, b_map, tile_m * BLOCK_M, tile_n * BLOCK_N, k_slice);
        }
        return;
    }
    float d[ACCUMULATORS];
    for (int tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
        int tile_m, tile_n;
        tile_coordinates(tile, tiles_m, tiles_n, tile_m, tile_n);
        clear_accumulators(d);
        for (int k_slice = 0; k_slice < slices; ++k_slice, ++slice) ring.consume(d, slice, 64 * warpgroup, thread);
        store_accumulators(c, N, tile_m * BLOCK_M + 64 * warpgroup, tile_n * BLOCK_N, thread, d);
    }
}
