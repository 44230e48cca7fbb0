// Step 4 of 4.4, double buffering: matmul_warp_tiles with two shared buffers for each operand. While the
// block multiplies the slice in one buffer, the next slice's global loads are in flight into registers;
// they are stored into the other buffer afterwards. One __syncthreads() per slice instead of two: the
// buffer being written was last read before the previous barrier. K and N multiples of 4, A and B
// 16-byte aligned.
constexpr int BLOCK_TILE = 128;  // rows and columns of C per block
constexpr int TILE_K = 8;        // depth of one slice of K
constexpr int THREAD_TILE = 8;   // rows and columns of C per thread

extern "C" __global__ void __launch_bounds__(256) matmul_double_buffered(
    float* C, const float* A, const float* B, int M, int N, int K)
{
    __shared__ __align__(16) float a_tiles[2][TILE_K][BLOCK_TILE];  // k-major: a_tiles[buffer][k][m]
    __shared__ __align__(16) float b_tiles[2][TILE_K][BLOCK_TILE];
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
    // The slice starting at k0, from global memory into registers (zero outside the matrices).
    auto load = [&](int k0, float4& a, float4& b) {
        a = (m0 + a_row < M && k0 + a_col < K) ? *reinterpret_cast<const float4*>(&A[(m0 + a_row) * K + k0 + a_col]) : zero;
        b = (k0 + b_row < K && n0 + b_col < N) ? *reinterpret_cast<const float4*>(&B[(k0 + b_row) * N + n0 + b_col]) : zero;
    };
    // ... and from registers into shared buffer `to`, A transposed.
    auto store = [&](int to, float4 a, float4 b) {
        a_tiles[to][a_col + 0][a_row] = a.x;
        a_tiles[to][a_col + 1][a_row] = a.y;
        a_tiles[to][a_col + 2][a_row] = a.z;
        a_tiles[to][a_col + 3][a_row] = a.w;
        *reinterpret_cast<float4*>(&b_tiles[to][b_row][b_col]) = b;
    };
    float4 a_next, b_next;
    load(0, a_next, b_next);
    store(0, a_next, b_next);
    __syncthreads();
    int buffer = 0;
    for (int k0 = 0; k0 < K; k0 += TILE_K) {
        bool more = k0 + TILE_K < K;
        if (more) load(k0 + TILE_K, a_next, b_next);  // in flight while the loop below computes
#pragma unroll
        for (int k = 0; k < TILE_K; ++k) {
            float4 a_low = *reinterpret_cast<const float4*>(&a_tiles[buffer][k][row_base]);
            float4 a_high = *reinterpret_cast<const float4*>(&a_tiles[buffer][k][row_base + 16]);
            float a_values[THREAD_TILE] = {a_low.x, a_low.y, a_low.z, a_low.w,
                                             a_high.x, a_high.y, a_high.z, a_high.w};
            float4 b_low = *reinterpret_cast<const float4*>(&b_tiles[buffer][k][col_base]);
            float4 b_high = *reinterpret_cast<const float4*>(&b_tiles[buffer][k][col_base + 32]);
            float b_values[THREAD_TILE] = {b_low.x, b_low.y, b_low.z, b_low.w,
                                             b_high.x, b_high.y, b_high.z, b_high.w};
#pragma unroll
            for (int i = 0; i < THREAD_TILE; ++i)
#pragma unroll
                for (int j = 0; j < THREAD_TILE; ++j)
                    acc[i][j] += a_values[i] * b_values[j];
        }
        if (more) store(1 - buffer, a_next, b_next);  // nobody reads 1 - buffer since the last barrier
        __syncthreads();
        buffer = 1 - buffer;
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
