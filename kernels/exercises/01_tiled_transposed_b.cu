constexpr int TILE = 32;

extern "C" __global__ void matmul_tiled_transposed_b(float* C, const float* A, const float* B, int M, int N, int K)
{
    __shared__ float a_tile[TILE][TILE];
    __shared__ float b_tile[TILE][TILE + 1];  // + 1: the column reads below hit 32 different banks
    int tx = threadIdx.x, ty = threadIdx.y;
    int row = blockIdx.y * TILE + ty;
    int col = blockIdx.x * TILE + tx;
    int b_row = blockIdx.x * TILE + ty;  // the row of B (a column of C) this thread copies
    float sum = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        // Both copies read along k, the contiguous dimension of A and of B: coalesced.
        a_tile[ty][tx] = (row < M && k0 + tx < K) ? A[row * K + k0 + tx] : 0.0f;
        b_tile[ty][tx] = (b_row < N && k0 + tx < K) ? B[b_row * K + k0 + tx] : 0.0f;
        __syncthreads();  // the tiles are complete before anyone reads them
        for (int k = 0; k < TILE; ++k) {
            sum += a_tile[ty][k] * b_tile[tx][k];  // C[row, col] needs row col of B
        }
        __syncthreads();  // nobody overwrites the tiles while others still read them
    }
    if (row < M && col < N) {
        C[row * N + col] = sum;
    }
}
