// C = A @ Bᵀ in TF32 on tensor cores, for A: M x K and B: N x K, row-major (the forward of a Linear layer,
// x Wᵀ: both operands have k along their rows). A block of 128 threads (4 warps) computes a 64 x 64 tile of
// C, walking along K 16 at a time; each warp owns a 32 x 32 part of it as 2 x 4 mma tiles of 16 x 8.
//  - Slices of A and B (64 rows of 16 floats each) sit in shared memory with every row padded by 4 floats
//    (16 bytes): the 8 rows an ldmatrix reads then start on 8 different groups of 4 banks (no conflicts).
//  - ldmatrix.x4 gives a warp the four registers of an A fragment, ldmatrix.x2 the two of a B fragment,
//    in one instruction each instead of one load per float.
// Two kernels share all of this and differ in how slices reach shared memory:
//  - tf32_matmul_tiled: each thread loads floats into registers and stores them, then the block waits
//    (any M, N, K; the load and the arithmetic take turns);
//  - tf32_matmul_pipelined: cp.async copies straight into shared memory, STAGES slices in flight, so the
//    next slices travel while this one is multiplied (K a multiple of 4, so rows start on 16 bytes).
#include "mma.cuh"

constexpr int TILE = 64;       // rows and columns of C per block
constexpr int DEPTH = 16;      // floats of K per slice
constexpr int STRIDE = DEPTH + 4;
constexpr int THREADS = 128;
constexpr int STAGES = 3;

// The warp's 2 x 4 mma tiles of one slice: (warp_row, warp_column) is its corner in the block's tile.
__device__ __forceinline__ void multiply_warp_tiles(float (&acc)[2][4][4], const float (*a_slice)[STRIDE],
                                               const float (*b_slice)[STRIDE], int warp_row, int warp_column)
{
    const int lane = threadIdx.x % 32;
    for (int k0 = 0; k0 < DEPTH; k0 += 8) {
        unsigned a[2][4], b[4][2];
        for (int i = 0; i < 2; ++i) {
            // lanes 0-15 name rows 0-15 at k0, lanes 16-31 the same rows at k0 + 4: four 8 x 4 blocks
            ldmatrix_x4(a[i], shared_address(&a_slice[warp_row + 16 * i + lane % 16][k0 + lane / 16 * 4]));
            for (int e = 0; e < 4; ++e) a[i][e] = to_tf32(__uint_as_float(a[i][e]));
        }
        for (int j = 0; j < 4; ++j) {
            // B's row n is column n of Bᵀ: lanes 0-7 name rows n at k0, lanes 8-15 at k0 + 4
            ldmatrix_x2(b[j], shared_address(&b_slice[warp_column + 8 * j + lane % 8][k0 + lane / 8 % 2 * 4]));
            for (int e = 0; e < 2; ++e) b[j][e] = to_tf32(__uint_as_float(b[j][e]));
        }
        for (int i = 0; i < 2; ++i)
            for (int j = 0; j < 4; ++j) mma_m16n8k8_tf32(acc[i][j], a[i], b[j]);
    }
}

// The warp's results into C (M x N), skipping what lies outside it.
__device__ __forceinline__ void store_warp_tiles(float* C, int M, int N, const float (&acc)[2][4][4], int first_row,
                                           int first_column)
{
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 4; ++j)
            for (int e = 0; e < 4; ++e) {
                const int row = first_row + 16 * i + g + 8 * (e / 2), column = first_column + 8 * j + 2 * t + e % 2;
                if (row < M && column < N) C[row * N + column] = acc[i][j][e];
            }
}

extern "C" __global__ void __launch_bounds__(THREADS) tf32_matmul_tiled(float* C, const float* A, const float* B,
                                                                        int M, int N, int K)
{
    __shared__ __align__(16) float a_slice[TILE][STRIDE];
    __shared__ __align__(16) float b_slice[TILE][STRIDE];
    const int m0 = blockIdx.y * TILE, n0 = blockIdx.x * TILE, warp = threadIdx.x / 32;
    const int warp_row = warp / 2 * 32, warp_column = warp % 2 * 32;
    float acc[2][4][4] = {};
    for (int k0 = 0; k0 < K; k0 += DEPTH) {
        for (int i = threadIdx.x; i < TILE * DEPTH; i += THREADS) {   // zeros outside A and B add nothing
            const int row = i / DEPTH, k = i % DEPTH;
            a_slice[row][k] = (m0 + row < M && k0 + k < K) ? A[(m0 + row) * K + k0 + k] : 0.0f;
            b_slice[row][k] = (n0 + row < N && k0 + k < K) ? B[(n0 + row) * K + k0 + k] : 0.0f;
        }
        __syncthreads();   // the slices are complete before any warp reads them
        multiply_warp_tiles(acc, a_slice, b_slice, warp_row, warp_column);
        __syncthreads();   // and fully read before the next ones overwrite them
    }
    store_warp_tiles(C, M, N, acc, m0 + warp_row, n0 + warp_column);
}

// Rows first_row.. of a matrix with K floats per row, columns k0..k0+15, into a slice by 16-byte cp.async:
// 64 rows of 4 copies, 2 per thread. A copy past the matrix reads 0 bytes and writes zeros.
__device__ __forceinline__ void copy_slice_async(float (*slice)[STRIDE], const float* matrix, int rows, int K,
                                           int first_row, int k0)
{
    for (int copy = threadIdx.x; copy < TILE * DEPTH / 4; copy += THREADS) {
        const int row = copy / (DEPTH / 4), k = copy % (DEPTH / 4) * 4;
        const bool inside = first_row + row < rows && k0 + k < K;   // K % 4 == 0: all four or none
        const float* source = inside ? matrix + (first_row + row) * K + k0 + k : matrix;
        cp_async_16(shared_address(&slice[row][k]), source, inside ? 16 : 0);
    }
}

extern "C" __global__ void __launch_bounds__(THREADS) tf32_matmul_pipelined(float* C, const float* A,
                                                                            const float* B, int M, int N, int K)
{
    __shared__ __align__(16) float a_slices[STAGES][TILE][STRIDE];
    __shared__ __align__(16) float b_slices[STAGES][TILE][STRIDE];
    const int m0 = blockIdx.y * TILE, n0 = blockIdx.x * TILE, warp = threadIdx.x / 32;
    const int warp_row = warp / 2 * 32, warp_column = warp % 2 * 32;
    const int slices = (K + DEPTH - 1) / DEPTH;
    float acc[2][4][4] = {};
    // STAGES - 1 slices set off before any arithmetic. Each slice is one commit group, and every thread
    // commits one per step even when it has nothing left to copy, so group counts stay in step with slices.
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < slices) {
            copy_slice_async(a_slices[s], A, M, K, m0, s * DEPTH);
            copy_slice_async(b_slices[s], B, N, K, n0, s * DEPTH);
        }
        cp_async_commit();
    }
    for (int s = 0; s < slices; ++s) {
        cp_async_wait<STAGES - 2>();   // slice s, copied by this thread, has landed (later ones may not have)
        __syncthreads();               // ... and so has every other thread's part; slice s - 1 is read
        const int next = s + STAGES - 1;
        if (next < slices) {           // into the stage slice s - 1 used
            copy_slice_async(a_slices[next % STAGES], A, M, K, m0, next * DEPTH);
            copy_slice_async(b_slices[next % STAGES], B, N, K, n0, next * DEPTH);
        }
        cp_async_commit();
        multiply_warp_tiles(acc, a_slices[s % STAGES], b_slices[s % STAGES], warp_row, warp_column);
    }
    store_warp_tiles(C, M, N, acc, m0 + warp_row, n0 + warp_column);
}
