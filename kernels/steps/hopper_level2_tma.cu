// Level 2: TMA and an mbarrier, double-buffered. One warpgroup per 64 x 128 tile of C, as in level 1, but
// one thread starts each slice's copy as two bulk tensor copies (the copy engine writes the swizzle itself),
// and the copy of slice s + 1 runs while the tensor cores multiply slice s. Each of the two stages has a
// "full" mbarrier that completes when its bytes have landed; a thread waits on it by phase parity: stage
// s % 2 is filled for the (s / 2)-th time, so slice s waits for the phase of parity (s / 2) % 2.
#include "hopper_levels.cuh"

constexpr int BLOCK_M = 64;
constexpr int STAGES = 2;
constexpr int A_SLICE_BYTES = BLOCK_M * ROW_BYTES;
constexpr int STAGE_BYTES = A_SLICE_BYTES + B_SLICE_BYTES;
constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;   // and room to start on 1024 bytes
static_assert(SHARED_BYTES <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

extern "C" __global__ void __launch_bounds__(128) hopper_level2(float* c, const __grid_constant__ TensorMap a_map,
                                                                const __grid_constant__ TensorMap b_map,
                                                                int M, int N, int K)
{
    extern __shared__ unsigned char shared[];
    __shared__ __align__(8) unsigned long long full_barriers[STAGES];
    const unsigned stage0 = aligned_1024(shared), full0 = shared_address(full_barriers);
    const int row0 = blockIdx.y * BLOCK_M, column0 = blockIdx.x * BLOCK_N, slices = K / SLICE_K;
    const bool copier = threadIdx.x == 0;
    if (copier) {
        for (int stage = 0; stage < STAGES; ++stage) mbarrier_init(full0 + 8 * stage, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (copier) tma_load_slice(stage0, stage0 + A_SLICE_BYTES, a_map, b_map, BLOCK_M, row0, column0, 0, full0);
    float d[ACCUMULATORS];
    clear_accumulators(d);
    for (int slice = 0; slice < slices; ++slice) {
        const int stage = slice % STAGES, next = (slice + 1) % STAGES;
        if (copier && slice + 1 < slices)   // the other stage was freed by the __syncthreads ending slice - 1
            tma_load_slice(stage0 + next * STAGE_BYTES, stage0 + next * STAGE_BYTES + A_SLICE_BYTES, a_map, b_map,
                       BLOCK_M, row0, column0, slice + 1, full0 + 8 * next);
        const unsigned a_tile = stage0 + stage * STAGE_BYTES;
        mbarrier_wait(full0 + 8 * stage, slice / STAGES % 2);
        wgmma_slice(d, a_tile, a_tile + A_SLICE_BYTES);
        wgmma_wait_group<0>();
        fence_accumulators(d);
        __syncthreads();   // this stage is read: the copy into it may start
    }
    store_accumulators(c, N, row0, column0, threadIdx.x, d);
}
