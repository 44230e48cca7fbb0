// C = A @ B where a block of 256 threads computes a 128 x 128 tile of C and each thread an 8 x 8
// patch of it, held in registers. Per step of k, a thread reads 8 floats of A and 8 of B from shared
// memory and does 64 multiply-adds with them: 4 multiply-adds per shared-memory load instead of 1/2.
constexpr int BLOCK_TILE = 128;  // rows and columns of C per block
constexpr int TILE_K = 8;        // depth of one slice of K
constexpr int THREAD_TILE = 8;   // rows and columns of C per thread

extern "C" __global__ void __launch_bounds__(256) matmul_register_blocked(
    float* C, const float* A, const float* B, int M, int N, int K)
{
    __shared__ float a_tile[BLOCK_TILE][TILE_K];
    __shared__ float b_tile[TILE_K][BLOCK_TILE];
    int thread = threadIdx.x;
    int thread_row = thread / 16;  // 16 x 16 threads, each owning rows thread_row*8 .. +7
    int thread_col = thread % 16;  // and columns thread_col*8 .. +7 of the block's tile
    int m0 = blockIdx.y * BLOCK_TILE;
    int n0 = blockIdx.x * BLOCK_TILE;

    // 64 running sums per thread. acc, a_values and b_values live in registers only because every loop
    // over them is unrolled, so each index is a compile-time constant.
    float acc[THREAD_TILE][THREAD_TILE] = {};
    float a_values[THREAD_TILE];
    float b_values[THREAD_TILE];
    for (int k0 = 0; k0 < K; k0 += TILE_K) {
        // Each tile holds 1024 floats: 4 per thread, neighbouring threads on neighbouring addresses.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            int e = thread + i * 256;
            int r = e / TILE_K, c = e % TILE_K;
            a_tile[r][c] = (m0 + r < M && k0 + c < K) ? A[(m0 + r) * K + k0 + c] : 0.0f;
            r = e / BLOCK_TILE;
            c = e % BLOCK_TILE;
            b_tile[r][c] = (k0 + r < K && n0 + c < N) ? B[(k0 + r) * N + n0 + c] : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < TILE_K; ++k) {
#pragma unroll
            for (int i = 0; i < THREAD_TILE; ++i) a_values[i] = a_tile[thread_row * THREAD_TILE + i][k];
#pragma unroll
            for (int j = 0; j < THREAD_TILE; ++j) b_values[j] = b_tile[k][thread_col * THREAD_TILE + j];
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
