// Level 4: two consumer warpgroups. Level 3's ring with a 128 x 128 tile of C: warpgroup w (threads
// 128w .. 128w + 127) multiplies rows 64w .. 64w + 63 of each slice of A by the whole slice of B, so a slice
// of B, copied once, feeds twice the products, and each stage's "empty" barrier waits for both warpgroups.
// The producer warp is threads 256-287.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 128;
constexpr int CONSUMERS = 2;
constexpr int STAGES = 4;
using SliceRing = Ring<STAGES, BLOCK_M>;   // 128 rows of A and 128 of B per stage: 32 KB

extern "C" __global__ void __launch_bounds__(288) hopper_level4(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];
    const SliceRing ring(shared, barriers);
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N, slices = K / SLICE_K;
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    if (threadIdx.x == 0) ring.init(CONSUMERS);   // one arrival on empty from each consumer warpgroup
    __syncthreads();
    if (warpgroup == CONSUMERS) {   // the producer warp
        if (thread == 0)
            for (int slice = 0; slice < slices; ++slice) ring.produce(slice, a_map, b_map, row0, column0, slice);
        return;
    }
    float d[ACCUMULATORS];
    clear_accumulators(d);
    for (int slice = 0; slice < slices; ++slice) ring.consume(d, slice, 64 * warpgroup, thread);   // its 64 rows of A
    store_accumulators(c, N, row0 + 64 * warpgroup, column0, thread, d);
}
