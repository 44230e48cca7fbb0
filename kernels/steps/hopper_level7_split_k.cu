// Level 7: split-K. A product with few tiles and a long K (the weight gradient dW = dyᵀ x sums over all
// B*T rows: 768 x 768 is 36 tiles of 128 x 128 for 132 multiprocessors) leaves most multiprocessors idle.
// Level 4's block, launched gridDim.z times over: block z sums only stretch z of K (K / gridDim.z, whole
// slices) and writes its partial sums to its own M x N slab, C + z M N. The launcher adds the slabs in
// stretch order afterwards, so the result is the same every run (atomic adds would land in whatever order
// the blocks finish). More blocks, each with a shorter loop: the price is one more pass over M x N floats.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 128;
constexpr int CONSUMERS = 2;
constexpr int STAGES = 4;
using SliceRing = Ring<STAGES, BLOCK_M>;

extern "C" __global__ void __launch_bounds__(288) hopper_level7(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];
    const SliceRing ring(shared, barriers);
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N;
    const int slices = K / SLICE_K / gridDim.z, first_slice = blockIdx.z * slices;   // this block's stretch
    c += (long long)blockIdx.z * M * N;                                               // and its slab
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    if (threadIdx.x == 0) ring.init(CONSUMERS);
    __syncthreads();
    if (warpgroup == CONSUMERS) {   // the producer warp
        if (thread == 0)
            for (int slice = 0; slice < slices; ++slice)
                ring.produce(slice, a_map, b_map, row0, column0, first_slice + slice);
        return;
    }
    float d[ACCUMULATORS];
    clear_accumulators(d);
    for (int slice = 0; slice < slices; ++slice) ring.consume(d, slice, 64 * warpgroup, thread);
    store_accumulators(c, N, row0 + 64 * warpgroup, column0, thread, d);
}
