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
constexpr int A_SLICE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int STAGE_BYTES = A_SLICE_BYTES + B_SLICE_BYTES;
constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;
static_assert(SHARED_BYTES <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

extern "C" __global__ void __launch_bounds__(288) hopper_level7(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long barriers[2 * STAGES];   // full[STAGES], then empty[STAGES]
    const unsigned stage0 = aligned_1024(shared), full0 = shared_address(barriers), empty0 = full0 + 8 * STAGES;
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N;
    const int slices = K / SLICE_K / gridDim.z, first_slice = blockIdx.z * slices;   // this block's stretch
    c += (long long)blockIdx.z * M * N;                                               // and its slab
    const int warpgroup = threadIdx.x / 128, thread = threadIdx.x % 128;
    if (threadIdx.x == 0) init_ring<STAGES>(full0, empty0, CONSUMERS);   // one arrival from each consumer warpgroup
    __syncthreads();
    if (warpgroup == CONSUMERS) {   // the producer warp
        if (thread == 0)
            for (int slice = 0; slice < slices; ++slice) {
                const int stage = slice % STAGES, round = slice / STAGES;
                const unsigned a_tile = stage0 + stage * STAGE_BYTES;
                mbarrier_wait(empty0 + 8 * stage, round % 2 ^ 1);
                tma_load_slice(a_tile, a_tile + A_SLICE_BYTES, a_map, b_map, BLOCK_M, row0, column0, first_slice + slice,
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
