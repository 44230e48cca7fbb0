constexpr int TILE = 32;

extern "C" __global__ void matmul_column_blocked(float* C, const float* A, const float* B, int M, int N, int K)
{
    __shared__ float a_tile[TILE][TILE];
    __shared__ float b_tile[TILE][TILE];
    int tx = threadIdx.x, ty = threadIdx.y;  // blocks of 32 x 8 threads
    int row0 = blockIdx.y * TILE, col = blockIdx.x * TILE + tx;
    float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += TILE) {
        for (int r = ty; r < TILE; r += 8) {  // 8 rows of threads copy 32 rows of each tile
            a_tile[r][tx] = (row0 + r < M && k0 + tx < K) ? A[(row0 + r) * K + k0 + tx] : 0.0f;
            b_tile[r][tx] = (k0 + r < K && col < N) ? B[(k0 + r) * N + col] : 0.0f;
        }
        __syncthreads();  // the tiles are complete before anyone reads them
        for (int k = 0; k < TILE; ++k) {
            float b = b_tile[k][tx];  // one shared load, four multiply-adds
            for (int i = 0; i < 4; ++i) sums[i] += a_tile[ty + 8 * i][k] * b;
        }
        __syncthreads();  // nobody overwrites the tiles while others still read them
    }
    for (int i = 0; i < 4; ++i) {
        int row = row0 + ty + 8 * i;
        if (row < M && col < N) C[row * N + col] = sums[i];
    }
}
