// Step 3 of 4.4, warp tiles: matmul_transposed_a with another owner for each output. A thread's 8 x 8
// outputs are four 4 x 4 quads, 16 rows and 32 columns apart; the 32 lanes of a warp, 4 rows of 8 lanes,
// cover a 32 x 64 warp tile, and the 8 warps (4 x 2) the block's 128 x 128. A warp's float4 loads from
// b_tile[k] then hit 8 consecutive float4s (128 bytes, every bank once; the other lanes read the same
// ones), and from a_tile[k] 4 consecutive ones. K and N multiples of 4, A and B 16-byte aligned.
constexpr int BLOCK_TILE = 128;  // rows and columns of C per block
constexpr int TILE_K = 8;        // depth of one slice of K
constexpr int THREAD_TILE = 8;   // rows and columns of C per thread

extern "C" __global__ void __launch_bounds__(256) matmul_warp_tiles(
    float* C, const float* A, const float* B, int M, int N, int K)
{
    __shared__ __align__(16) float a_tile[TILE_K][BLOCK_TILE];  // k-major: a_tile[k][m]
    __shared__ __align__(16) float b_tile[TILE_K][BLOCK_TILE];
    int thread = threadIdx.x;
    int warp = thread / 32, lane = thread % 32;
    int row_base = warp / 2 * 32 + lane / 8 * 4;  // the thread's first row in the block's tile; quads at +0, +16
    int col_base = warp % 2 * 64 + lane % 8 * 4;  // its first column; quads at +0, +32
    int m0 = blockIdx.y * BLOCK_TILE, n0 = blockIdx.x * BLOCK_TILE;
    // A's 128 x 8 slice is 128 rows of two float4s, B's 8 x 128 slice 8 rows of 32: one float4 each per thread.
    int a_row = thread / 2, a_col = thread % 2 * 4;
    int b_row = thread / 32, b_col = thread % 32 * 4;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    float acc[THREAD_TILE][THREAD_TILE] = {};
    for (int k0 = 0; k0 < K; k0 += TILE_K) {
        float4 a = (m0 + a_row < M && k0 + a_col < K)
            ? *reinterpret_cast<const float4*>(&A[(m0 + a_row) * K + k0 + a_col]) : zero;
        a_tile[a_col + 0][a_row] = a.x;  // four values of k: four rows of the k-major tile
        a_tile[a_col + 1][a_row] = a.y;
        a_tile[a_col + 2][a_row] = a.z;
        a_tile[a_col + 3][a_row] = a.w;
        *reinterpret_cast<float4*>(&b_tile[b_row][b_col]) = (k0 + b_row < K && n0 + b_col < N)
            ? *reinterpret_cast<const float4*>(&B[(k0 + b_row) * N + n0 + b_col]) : zero;
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE_K; ++k) {
            float4 a_low = *reinterpret_cast<const float4*>(&a_tile[k][row_base]);
            float4 a_high = *reinterpret_cast<const float4*>(&a_tile[k][row_base + 16]);
            float a_values[THREAD_TILE] = {a_low.x, a_low.y, a_low.z, a_low.w,
                                             a_high.x, a_high.y, a_high.z, a_high.w};
            float4 b_low = *reinterpret_cast<const float4*>(&b_tile[k][col_base]);
            float4 b_high = *reinterpret_cast<const float4*>(&b_tile[k][col_base + 32]);
            float b_values[THREAD_TILE] = {b_low.x, b_low.y, b_low.z, b_low.w,
                                             b_high.x, b_high.y, b_high.z, b_high.w};
#pragma unroll
            for (int i = 0; i < THREAD_TILE; ++i)
#pragma unroll
                for (int j = 0; j < THREAD_TILE; ++j)
                    acc[i][j] += a_values[i] * b_values[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < THREAD_TILE; ++i) {
        int row = m0 + row_base + i % 4 + i / 4 * 16;
#pragma unroll
        for (int j = 0; j < THREAD_TILE; ++j) {
            int col = n0 + col_base + j % 4 + j / 4 * 32;
            if (row < M && col < N) C[row * N + col] = acc[i][j];
        }
    }
}
