// Level 3: a producer warp and a full/empty ring. The block is one consumer warpgroup (threads 0-127, a
// 64 x 128 tile of C) and one producer warp (threads 128-159), of which one thread issues every copy, through
// a ring of STAGES slices (Ring in hopper_levels.cuh: a "full" and an "empty" mbarrier per stage, waited on by
// the parity of the slice's round). No __syncthreads in the loop: the producer runs up to STAGES slices ahead.
#include "hopper_levels.cuh"

constexpr int STAGES = 4;
using SliceRing = Ring<STAGES, 64>;   // 64 rows of A and 128 of B per stage: 24 KB

extern "C" __global__ void __launch_bounds__(160) hopper_level3(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];   // full[STAGES], then empty[STAGES]
    const SliceRing ring(shared, barriers);
    const int row0 = blockIdx.y * 64, column0 = blockIdx.x * BLOCK_N, slices = K / SLICE_K;
    if (threadIdx.x == 0) ring.init(1);   // one arrival on empty: the consumer warpgroup's
    __syncthreads();
    if (threadIdx.x >= 128) {   // the producer warp, of which one thread copies
        if (threadIdx.x == 128)
            for (int slice = 0; slice < slices; ++slice) ring.produce(slice, a_map, b_map, row0, column0, slice);
        return;
    }
    float d[ACCUMULATORS];
    clear_accumulators(d);
    for (int slice = 0; slice < slices; ++slice) ring.consume(d, slice, 0, threadIdx.x);
    store_accumulators(c, N, row0, column0, threadIdx.x, d);
}
