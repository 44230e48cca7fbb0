// Level 6: ping-pong. Level 5's persistent block, but the two consumer warpgroups no longer share a tile:
// they take whole 128 x 128 tiles in turn (the block's tiles j = 0, 2, 4, ... to warpgroup 0, 1, 3, 5, ...
// to warpgroup 1), each computing all 128 rows (two m64n128 products per step of k, 2 x 64 accumulators).
// The producer fills the ring in tile order. So one warpgroup stores its tile while the other multiplies,
// and the tensor cores do not wait for the stores. A "turn" mbarrier per warpgroup lets it start a tile once
// the other has issued all of its own: a wait by parity only tells adjacent phases apart, and without the
// turn a warpgroup waiting for a slice two rounds of the ring ahead would take an earlier round's bytes.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 128;
constexpr int STAGES = 4;
using SliceRing = Ring<STAGES, BLOCK_M>;

extern "C" __global__ void __launch_bounds__(288) hopper_level6(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES], turns[2];
    const SliceRing ring(shared, barriers);
    const unsigned turn0 = shared_address(turns);   // turns[w]: warpgroup w may start its next tile
    const int tiles_m = M / BLOCK_M, tiles_n = N / BLOCK_N, tiles = tiles_m * tiles_n, slices = K / SLICE_K;
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    if (threadIdx.x == 0) {
        mbarrier_init(turn0, 1);       // one arrival: the other warpgroup's
        mbarrier_init(turn0 + 8, 1);
        ring.init(1);                  // only the warpgroup whose tile it is reads a slice
    }
    __syncthreads();
    if (warpgroup == 2) {   // the producer warp: every tile of the block, in order
        if (thread != 0) return;
        int slice = 0;
        for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
            int tile_m, tile_n;
            tile_coordinates(tile, tiles_m, tiles_n, tile_m, tile_n);
            for (int k_slice = 0; k_slice < slices; ++k_slice, ++slice)
                ring.produce(slice, a_map, b_map, tile_m * BLOCK_M, tile_n * BLOCK_N, k_slice);
        }
        return;
    }
    float top[ACCUMULATORS], bottom[ACCUMULATORS];   // rows 0-63 and 64-127 of the tile
    int turn = 0;                                    // this warpgroup's tiles so far
    for (int j = warpgroup, tile = blockIdx.x + warpgroup * gridDim.x; tile < tiles;
         j += 2, tile += 2 * gridDim.x, ++turn) {
        // Warpgroup 1's turn-th tile follows warpgroup 0's turn-th; warpgroup 0's follows 1's (turn - 1)-th.
        if (warpgroup == 1) mbarrier_wait(turn0 + 8, turn % 2);
        else if (turn > 0) mbarrier_wait(turn0, (turn - 1) % 2);
        int tile_m, tile_n;
        tile_coordinates(tile, tiles_m, tiles_n, tile_m, tile_n);
        clear_accumulators(top);
        clear_accumulators(bottom);
        for (int slice = j * slices; slice < (j + 1) * slices; ++slice) {   // the block's j-th tile's slices
            ring.wait_full(slice);
            wgmma_slice(top, ring.a_tile(slice), ring.b_tile(slice));
            wgmma_slice(bottom, ring.a_tile(slice) + 64 * ROW_BYTES, ring.b_tile(slice));
            wgmma_wait_group<0>();
            fence_accumulators(top);
            fence_accumulators(bottom);
            if (thread == 0) ring.release(slice);
        }
        if (thread == 0) mbarrier_arrive(turn0 + 8 * (1 - warpgroup));   // the other may start its tile
        store_accumulators(c, N, tile_m * BLOCK_M, tile_n * BLOCK_N, thread, top);
        store_accumulators(c, N, tile_m * BLOCK_M + 64, tile_n * BLOCK_N, thread, bottom);
    }
}
