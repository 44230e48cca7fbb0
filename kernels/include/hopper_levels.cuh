// What every level of chapter 15b's Hopper GEMM shares: C = A Bᵀ for bf16 A (M x K) and B (N x K), both
// row-major with k contiguous (K-major, the Linear layer's forward x Wᵀ), C float32 (M x N). The levels keep
// the sizes whole to stay short: M a multiple of the block's rows, N of 128, K of 64 (the shipped
// kernels/wgmma_matmul.cu takes any size). Compiled for sm_90a: RawModule(code, options=("-arch=sm_90a",)).
#ifndef GPT2_CUPY_HOPPER_LEVELS_CUH
#define GPT2_CUPY_HOPPER_LEVELS_CUH
#include <cuda_bf16.h>
#include "tma.cuh"
#include "wgmma.cuh"

constexpr int BLOCK_N = 128;                     // columns of C per tile: one wgmma m64n128k16
constexpr int SLICE_K = 64;                      // k per slice: 64 bf16, one swizzled row of 128 bytes
constexpr int ROW_BYTES = SLICE_K * 2;
constexpr int ACCUMULATORS = BLOCK_N / 2;        // float32 registers per thread for 64 x 128
constexpr int B_SLICE_BYTES = BLOCK_N * ROW_BYTES;

// The four wgmma of one slice: d += (64 rows of A from a_tile) (B's 128 columns from b_tile)ᵀ, k = 0, 16,
// 32, 48 of the slice, each 32 bytes further along every swizzled row. Issued as one group, not waited for.
__device__ __forceinline__ void wgmma_slice(float (&d)[ACCUMULATORS], unsigned a_tile, unsigned b_tile)
{
    wgmma_fence();
#pragma unroll
    for (int k_step = 0; k_step < SLICE_K / 16; ++k_step)
        wgmma_m64n128k16_bf16(d, matrix_descriptor_128b(a_tile + 32 * k_step),
                              matrix_descriptor_128b(b_tile + 32 * k_step));
    wgmma_commit_group();
}

// One warpgroup's 64 x 128 accumulator to C at (row0, column0): thread `thread` (0-127) of the warpgroup
// holds, in warp w = thread / 32 with g = lane / 4 and t = lane % 4, d[i] at row 16w + g + 8 ((i / 2) % 2),
// column 8 (i / 4) + 2t + i % 2 (wgmma.cuh); pairs of neighbouring columns go out as one float2.
__device__ __forceinline__ void store_accumulators(float* c, int N, int row0, int column0, int thread,
                                                   const float (&d)[ACCUMULATORS])
{
    const int warp = thread / 32, g = thread % 32 / 4, t = thread % 4;
#pragma unroll
    for (int i = 0; i < ACCUMULATORS; i += 2) {
        const int row = row0 + 16 * warp + g + 8 * (i / 2 % 2), column = column0 + 8 * (i / 4) + 2 * t;
        *reinterpret_cast<float2*>(c + (long long)row * N + column) = make_float2(d[i], d[i + 1]);
    }
}

template <int COUNT>
__device__ __forceinline__ void clear_accumulators(float (&d)[COUNT])
{
#pragma unroll
    for (int i = 0; i < COUNT; ++i) d[i] = 0.0f;
}

// The shared address of `shared` rounded up to 1024 bytes, where the 128-byte swizzle pattern repeats.
__device__ __forceinline__ unsigned aligned_1024(const void* shared)
{
    return (shared_address(shared) + 1023) & ~1023u;
}

// The block's THREADS threads copy one slice (64 bf16 of each of `rows` rows, from `source`, rows K apart)
// into `tile` by cp.async in the 128-byte swizzle the descriptors name: chunk c of row r at chunk c ^ (r % 8).
// Rows from `valid_rows` on are past the matrix: cp.async reads 0 bytes of them and writes zeros.
template <int THREADS>
__device__ __forceinline__ void copy_slice_swizzled(unsigned tile, const __nv_bfloat16* source, int rows,
                                                    int valid_rows, int K)
{
    for (int chunk = threadIdx.x; chunk < rows * 8; chunk += THREADS) {
        const int row = chunk / 8, column = chunk % 8, valid = row < valid_rows;
        cp_async_16(tile + row * ROW_BYTES + 16 * (column ^ row % 8),
                    source + (long long)(valid ? row : 0) * K + 8 * column, valid ? 16 : 0);
    }
}

// One thread starts the copies of slice `slice` (k from 64 slice) of A's rows row0 .. + A_ROWS and B's rows
// column0 .. + 128 by TMA, and tells `full` to wait for their bytes (the maps' boxes are A_ROWS x 64 and
// 128 x 64, with the 128-byte swizzle).
__device__ __forceinline__ void tma_load_slice(unsigned a_tile, unsigned b_tile, const TensorMap& a_map,
                                           const TensorMap& b_map, int a_rows, int row0, int column0, int slice,
                                           unsigned full)
{
    mbarrier_arrive_expect_tx(full, a_rows * ROW_BYTES + B_SLICE_BYTES);
    tma_load_2d(a_tile, a_map, slice * SLICE_K, row0, full);
    tma_load_2d(b_tile, b_map, slice * SLICE_K, column0, full);
}

// A ring of STAGES slices in dynamic shared memory (levels 3 to 7): each stage holds a slice of A_ROWS rows of
// A and 128 rows of B, and has two mbarriers: "full" completes when the stage's bytes have landed, "empty" when
// every consumer warpgroup is done reading it. Slice s of a block's walk lives in stage s % STAGES, in round
// s / STAGES of the ring: a consumer waits for full's phase of parity round % 2; the producer, before it fills
// the stage again, for the previous round's empty phase, parity (round - 1) % 2 = (round % 2) ^ 1, which on a
// fresh barrier (round 0) returns at once.
template <int STAGES, int A_ROWS>
struct Ring {
    static constexpr int A_BYTES = A_ROWS * ROW_BYTES;
    static constexpr int STAGE_BYTES = A_BYTES + B_SLICE_BYTES;
    static constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;   // and room to start on 1024 bytes
    static_assert(SHARED_BYTES <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");
    unsigned stage0, full0, empty0;   // shared addresses: the first stage, full[0] and empty[0], barriers 8 apart
    // `barriers`: 2 * STAGES mbarriers in shared memory, full ones then empty ones.
    __device__ Ring(const void* shared, const unsigned long long* barriers)
        : stage0(aligned_1024(shared)), full0(shared_address(barriers)), empty0(full0 + 8 * STAGES) {}

    // By one thread, before a __syncthreads: full expects the producer's arrival (and the bytes), empty one
    // arrival from each of `consumers` warpgroups.
    __device__ void init(unsigned consumers) const
    {
        for (int stage = 0; stage < STAGES; ++stage) {
            mbarrier_init(full0 + 8 * stage, 1);
            mbarrier_init(empty0 + 8 * stage, consumers);
        }
        fence_mbarrier_init();
    }
    __device__ unsigned a_tile(int slice) const { return stage0 + slice % STAGES * STAGE_BYTES; }
    __device__ unsigned b_tile(int slice) const { return a_tile(slice) + A_BYTES; }
    // The producer's thread: wait until slice's stage is empty, then copy slice k_slice of K of the tile at
    // (row0, column0) into it.
    __device__ void produce(int slice, const TensorMap& a_map, const TensorMap& b_map, int row0, int column0,
                            int k_slice) const
    {
        mbarrier_wait(empty0 + 8 * (slice % STAGES), slice / STAGES % 2 ^ 1);
        tma_load_slice(a_tile(slice), b_tile(slice), a_map, b_map, A_ROWS, row0, column0, k_slice,
                       full0 + 8 * (slice % STAGES));
    }
    __device__ void wait_full(int slice) const { mbarrier_wait(full0 + 8 * (slice % STAGES), slice / STAGES % 2); }
    __device__ void release(int slice) const { mbarrier_arrive(empty0 + 8 * (slice % STAGES)); }
    // A consumer warpgroup: wait for the slice, multiply its A rows a_row .. a_row + 63 by B into d, wait for
    // the products, and (the warpgroup's thread 0 for all) release the stage.
    __device__ void consume(float (&d)[ACCUMULATORS], int slice, int a_row, int thread) const
    {
        wait_full(slice);
        wgmma_slice(d, a_tile(slice) + a_row * ROW_BYTES, b_tile(slice));
        wgmma_wait_group<0>();
        fence_accumulators(d);
        if (thread == 0) release(slice);
    }
};

// Persistent blocks walk the tiles `tile`, `tile` + gridDim.x, ... In row order, blocks running at the same
// time would each want a different row of A and the whole of B; taken down the columns of groups of GROUP_M
// rows of tiles, the blocks of one moment share a few rows of A and columns of B, which the L2 cache keeps.
constexpr int GROUP_M = 8;
__device__ __forceinline__ void tile_coordinates(int tile, int tiles_m, int tiles_n, int& tile_m, int& tile_n)
{
    const int group = tile / (GROUP_M * tiles_n), first_m = group * GROUP_M;
    const int group_rows = min(tiles_m - first_m, GROUP_M), within = tile % (GROUP_M * tiles_n);
    tile_m = first_m + within % group_rows;
    tile_n = within / group_rows;
}
#endif  // GPT2_CUPY_HOPPER_LEVELS_CUH
