#include "mma.cuh"

// One warp per block, one 16 x 8 tile of C = A B per warp, for any M, N, K: values past an edge load as
// zeros (they add nothing), results past an edge are not stored.
extern "C" __global__ void mma_tiles_tf32(float* C, const float* A, const float* B, int M, int N, int K)
{
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    const int row0 = blockIdx.y * 16, column0 = blockIdx.x * 8;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned a[4], b[2];
        for (int e = 0; e < 4; ++e) {   // a[e] = A(g + 8 (e % 2), t + 4 (e / 2)) of the tile
            const int row = row0 + g + 8 * (e % 2), k = k0 + t + 4 * (e / 2);
            a[e] = to_tf32(row < M && k < K ? A[row * K + k] : 0.0f);
        }
        for (int e = 0; e < 2; ++e) {   // b[e] = B(t + 4e, g) of the tile: down a column
            const int k = k0 + t + 4 * e, column = column0 + g;
            b[e] = to_tf32(k < K && column < N ? B[k * N + column] : 0.0f);
        }
        mma_m16n8k8_tf32(d, a, b);
    }
    for (int e = 0; e < 4; ++e) {       // d[e] = D(g + 8 (e / 2), 2t + e % 2)
        const int row = row0 + g + 8 * (e / 2), column = column0 + 2 * t + e % 2;
        if (row < M && column < N) C[row * N + column] = d[e];
    }
}
