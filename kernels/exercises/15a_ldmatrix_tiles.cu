#include "mma.cuh"

constexpr int STRIDE = 12;   // 8 floats of k per row, padded by 4: ldmatrix's 8 rows start on banks 12r mod 32

// C = A Bᵀ (B stored N x K, k contiguous like A), one warp per block and one 16 x 8 tile of C per warp. Each
// slice of 8 along k goes to shared memory (zeros past the edges), and the fragments come back by ldmatrix:
// lane 8q + r names row r of 8 x 4-float matrix q, and register q of lane (g, t) receives float t of row g of
// matrix q, which is exactly TF32's fragment order.
extern "C" __global__ void mma_tiles_ldmatrix(float* C, const float* A, const float* B, int M, int N, int K)
{
    __shared__ __align__(16) float a_tile[16 * STRIDE];
    __shared__ __align__(16) float b_tile[8 * STRIDE];
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4, q = lane / 8, r = lane % 8;
    const int row0 = blockIdx.y * 16, column0 = blockIdx.x * 8;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 8) {
        for (int e = lane; e < 16 * 8; e += 32) {
            const int row = row0 + e / 8, k = k0 + e % 8;
            a_tile[e / 8 * STRIDE + e % 8] = row < M && k < K ? A[row * K + k] : 0.0f;
        }
        for (int e = lane; e < 8 * 8; e += 32) {
            const int column = column0 + e / 8, k = k0 + e % 8;
            b_tile[e / 8 * STRIDE + e % 8] = column < N && k < K ? B[column * K + k] : 0.0f;
        }
        __syncwarp();   // the slice is in (the block is one warp)
        // A's four matrices: rows 0-7 and 8-15 (q % 2) of k 0-3 and 4-7 (q / 2); B's two: k 0-3 and 4-7
        unsigned a[4], b[2];
        ldmatrix_x4(a, shared_address(a_tile + (r + 8 * (q % 2)) * STRIDE + 4 * (q / 2)));
        ldmatrix_x2(b, shared_address(b_tile + r * STRIDE + 4 * (q % 2)));
        for (int e = 0; e < 4; ++e) a[e] = to_tf32(__uint_as_float(a[e]));
        for (int e = 0; e < 2; ++e) b[e] = to_tf32(__uint_as_float(b[e]));
        mma_m16n8k8_tf32(d, a, b);
        __syncwarp();   // every lane has read the slice before the next one overwrites it
    }
    for (int e = 0; e < 4; ++e) {
        const int row = row0 + g + 8 * (e / 2), column = column0 + 2 * t + e % 2;
        if (row < M && column < N) C[row * N + column] = d[e];
    }
}
