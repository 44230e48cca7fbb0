// C = A Bᵀ (+ bias) (+ C) on Hopper's tensor cores through wgmma: A is M x K and B is N x K, both bf16 and
// row-major with k contiguous (the Linear layer's x Wᵀ, x: (B*T, C_in), W: (C_out, C_in)); C is M x N,
// row-major, float32 or bf16. Sums are float32; bias (N float32s, or null) is added to each row and, with
// accumulate, C's old values, before the one rounding to C's type. Any M and N; K a multiple of 8, so that
// rows are whole 16-byte chunks.
// Compiled for sm_90a: RawModule(code, options=("-arch=sm_90a",)).
//
// A block of 256 threads, two warpgroups, computes a 128 x 256 tile of C, walking along K 64 at a time:
//  - each slice of 64 along K travels to shared memory by cp.async, 16 bytes per copy: A's 128 x 64 tile and
//    B's 256 x 64 tile, as rows of 128 bytes in the 128-byte swizzle (chunk c of row r lands at chunk
//    c ^ (r % 8) of the row), the layout the wgmma descriptors name; copies past an edge write zeros;
//  - STAGES slices live in shared memory: while the tensor cores multiply slice s, slices s + 1 and s + 2 are
//    on their way;
//  - warpgroup w multiplies rows 64w .. 64w + 63 of the tile by all 256 columns: per slice four wgmma
//    m64n256k16 (k = 0, 16, 32, 48), issued together and left running while the threads start the next
//    copies; 128 float32 accumulators per thread;
//  - blocks take their tiles down the columns of groups of GROUP_M rows of tiles, so that blocks running
//    at the same time share tiles of A and B in the L2 cache.
#include <cuda_bf16.h>
#include "wgmma.cuh"

constexpr int BLOCK_M = 128;                // rows of C per block: one warpgroup per 64
constexpr int BLOCK_N = 256;                // columns of C per block: one m64n256k16 per warpgroup and k-step
constexpr int BLOCK_K = 64;                 // elements of K per slice: 128 bytes, one swizzled row
constexpr int WARPGROUPS = BLOCK_M / 64;
constexpr int THREADS = 128 * WARPGROUPS;
constexpr int STAGES = 4;                   // slices in shared memory
static_assert(STAGES >= 3, "a slice being multiplied, one whose products may still run, and one on its way");
constexpr int GROUP_M = 8;                  // rows of tiles per group of blocks
constexpr int ROW_BYTES = BLOCK_K * 2;
constexpr int A_TILE_BYTES = BLOCK_M * ROW_BYTES;   // 16 KB
constexpr int B_TILE_BYTES = BLOCK_N * ROW_BYTES;   // 32 KB
constexpr int STAGE_BYTES = A_TILE_BYTES + B_TILE_BYTES;
static_assert(STAGE_BYTES % 1024 == 0, "every tile starts on 1024 bytes, where the swizzle pattern repeats");
// Dynamic shared memory per block: the stages, and room to start them on 1024 bytes (193 KB).
constexpr int SHARED_BYTES = STAGES * STAGE_BYTES + 1024;
static_assert(SHARED_BYTES <= 227 * 1024, "a block of an H100 or H200 has at most 227 KB of shared memory");

// Start copying rows first_row .. first_row + ROWS - 1, k = k0 .. k0 + 63 of `matrix` (rows x K, k contiguous)
// into the tile at shared address `tile`, swizzled. Eight threads copy one row's 128 bytes: consecutive
// threads read consecutive global memory. A chunk outside the matrix is zero-filled (K is a multiple of 8,
// so a chunk is all inside or all outside).
template <int ROWS>
__device__ __forceinline__ void copy_tile(unsigned tile, const __nv_bfloat16* matrix, int rows, int K,
                                          int first_row, int k0)
{
    constexpr int CHUNKS = ROWS * ROW_BYTES / 16;
    static_assert(CHUNKS % THREADS == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; ++i) {
        const int chunk = threadIdx.x + i * THREADS;
        const int row = chunk / 8, column = chunk % 8;   // column: which 16 bytes (8 elements) of the row
        const int matrix_row = first_row + row, k = k0 + 8 * column;
        const bool inside = matrix_row < rows && k < K;
        const __nv_bfloat16* source = inside ? matrix + (long long)matrix_row * K + k : matrix;
        cp_async_16(tile + row * ROW_BYTES + (column ^ (row % 8)) * 16, source, inside ? 16 : 0);
    }
}

// Stores into C, float32 or bf16 (rounded to nearest, ties to even). A pair of neighbours in a row is one
// 8-byte (4-byte) store; it needs an even N, so that every row starts on a multiple of that size.
__device__ __forceinline__ float load_one(const float* in) { return *in; }
__device__ __forceinline__ float load_one(const __nv_bfloat16* in) { return __bfloat162float(*in); }
__device__ __forceinline__ void store_one(float* out, float x) { *out = x; }
__device__ __forceinline__ void store_one(__nv_bfloat16* out, float x) { *out = __float2bfloat16_rn(x); }

__device__ __forceinline__ void store_pair(float* out, float x, float y)
{
    *reinterpret_cast<float2*>(out) = make_float2(x, y);
}

__device__ __forceinline__ void store_pair(__nv_bfloat16* out, float x, float y)
{
    *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(x, y);
}

// The whole product for one block, into a float32 or bf16 C.
template <typename Output>
__device__ __forceinline__ void wgmma_block_product(Output* C, const __nv_bfloat16* A, const __nv_bfloat16* B, int M,
                                                    int N, int K, const float* bias, bool accumulate)
{
    extern __shared__ __align__(1024) unsigned char shared[];
    // The swizzle acts on shared-memory address bits, so each stage starts on 1024 bytes of that address.
    const unsigned stages = (shared_address(shared) + 1023) & ~1023u;

    // This block's tile: groups of GROUP_M rows of tiles, numbered down each column of the group.
    const int tiles_m = (M + BLOCK_M - 1) / BLOCK_M, tiles_n = (N + BLOCK_N - 1) / BLOCK_N;
    const int per_group = GROUP_M * tiles_n, group = blockIdx.x / per_group, in_group = blockIdx.x % per_group;
    const int first_tile_m = group * GROUP_M, group_rows = min(tiles_m - first_tile_m, GROUP_M);
    const int m0 = (first_tile_m + in_group % group_rows) * BLOCK_M, n0 = in_group / group_rows * BLOCK_N;
    const int warpgroup = threadIdx.x / 128;

    auto a_tile = [&](int stage) { return stages + stage * STAGE_BYTES; };
    auto b_tile = [&](int stage) { return stages + stage * STAGE_BYTES + A_TILE_BYTES; };
    auto start_slice = [&](int s) {
        copy_tile<BLOCK_M>(a_tile(s % STAGES), A, M, K, m0, s * BLOCK_K);
        copy_tile<BLOCK_N>(b_tile(s % STAGES), B, N, K, n0, s * BLOCK_K);
    };

    float d[BLOCK_N / 2];
#pragma unroll
    for (int i = 0; i < BLOCK_N / 2; ++i) d[i] = 0.0f;
    fence_accumulators(d);

    // Fill the pipeline: STAGES - 2 slices on their way. Every thread commits one group of copies per slice,
    // even an empty one past the end, so that "all but the newest STAGES - 3 groups" means "up to slice s".
    const int slices = (K + BLOCK_K - 1) / BLOCK_K;
    for (int s = 0; s < STAGES - 2; ++s) {
        if (s < slices) start_slice(s);
        cp_async_commit();
    }
    for (int s = 0; s < slices; ++s) {
        cp_async_wait<STAGES - 3>();   // this thread's copies of slice s have landed,
        fence_proxy_async_shared();     // where the tensor cores' own reads see them;
        __syncthreads();                // everyone's too, and every warpgroup is done with slice s - 2
        const int stage = s % STAGES;
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < BLOCK_K / 16; ++k) {   // 32 bytes further along each swizzled row per step of 16
            wgmma_m64n256k16_bf16(d, matrix_descriptor_128b(a_tile(stage) + warpgroup * 64 * ROW_BYTES + 32 * k),
                                  matrix_descriptor_128b(b_tile(stage) + 32 * k));
        }
        wgmma_commit_group();
        // While they run: slice s + STAGES - 2 into the stage slice s - 2 had.
        if (s + STAGES - 2 < slices) start_slice(s + STAGES - 2);
        cp_async_commit();
        wgmma_wait_group<1>();          // slice s - 1's products are done; slice s's may still run
    }
    wgmma_wait_group<0>();
    fence_accumulators(d);

    // d[i] of warp w (of this warpgroup), lane 4g + t: row 16w + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2t + i % 2
    const int warp = threadIdx.x % 128 / 32, lane = threadIdx.x % 32;
    const int first_row = m0 + warpgroup * 64 + warp * 16 + lane / 4, first_column = n0 + 2 * (lane % 4);
#pragma unroll
    for (int i = 0; i < BLOCK_N / 2; i += 2) {
        const int row = first_row + 8 * (i / 2 % 2), column = first_column + 8 * (i / 4);
        if (row >= M || column >= N) continue;
        Output* out = C + (long long)row * N + column;
        const bool second = column + 1 < N;
        float x = d[i], y = d[i + 1];
        if (bias != nullptr) {
            x += bias[column];
            if (second) y += bias[column + 1];
        }
        if (accumulate) {
            x += load_one(out);
            if (second) y += load_one(out + 1);
        }
        if (N % 2 == 0) {
            store_pair(out, x, y);   // column is even, so column + 1 < N too
        } else {
            store_one(out, x);
            if (second) store_one(out + 1, y);
        }
    }
}

// Dynamic shared memory: SHARED_BYTES. Grid: one block per 128 x 256 tile of C, 1-D.
extern "C" __global__ void __launch_bounds__(THREADS, 1) wgmma_matmul_float32(
    float* __restrict__ C, const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ B, int M, int N, int K,
    const float* __restrict__ bias, bool accumulate)
{
    wgmma_block_product(C, A, B, M, N, K, bias, accumulate);
}

extern "C" __global__ void __launch_bounds__(THREADS, 1) wgmma_matmul_bfloat16(
    __nv_bfloat16* __restrict__ C, const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ B, int M,
    int N, int K, const float* __restrict__ bias, bool accumulate)
{
    wgmma_block_product(C, A, B, M, N, K, bias, accumulate);
}
