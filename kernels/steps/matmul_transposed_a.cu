// Step 2 of 4.4, A transposed in shared memory: matmul_float4 with the slice of A stored k-major,
// a_tile[k][m]. A thread's 8 values of A (8 rows, one k) are then neighbours, and two float4 loads fetch
// them, as for B. The transpose costs nothing extra: the float4 read from A is written to shared memory
// one float at a time. K and N multiples of 4, A and B 16-byte aligned.
constexpr int BLOCK_TILE = 128;  // rows and columns of C per block
constexpr int TILE_K = 8;        // depth of one slice of K
constexpr int THREAD_TILE = 8;   // rows and columns of C per thread

extern "C" __global__ void __launch_bounds__(256) matmul_transposed_a(
    float* C, const float* A, const float* B, int M, int N, int K)
{
    __shared__ __align__(16) float a_tile[TILE_K][BLOCK_TILE];  // k-major: a_tile[k][m]
    __shared__ __align__(16) float b_tile[TILE_K][BLOCK_TILE];
    int thread = threadIdx.x;
    int thread_row = thread / 16, thread_col = thread % 16;  // as in matmul_register_blocked
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
            float4 a_low = *reinterpret_cast<const float4*>(&a_tile[k][thread_row * THREAD_TILE]);
            float4 a_high = *reinterpret_cast<const float4*>(&a_tile[k][thread_row * THREAD_TILE + 4]);
            float a_values[THREAD_TILE] = {a_low.x, a_low.y, a_low.z, a_low.w,
                                             a_high.x, a_high.y, a_high.z, a_high.w};
            float4 b_low = *reinterpret_cast<const float4*>(&b_tile[k][thread_col * THREAD_TILE]);
            float4 b_high = *reinterpret_cast<const float4*>(&b_tile[k][thread_col * THREAD_TILE + 4]);
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
        int row = m0 + thread_row * THREAD_TILE + i;
#pragma unroll
        for (int j = 0; j < THREAD_TILE; ++j) {
            int col = n0 + thread_col * THREAD_TILE + j;
            if (row < M && col < N) C[row * N + col] = acc[i][j];
        }
    }
}
