// One warp, one 16 x 8 tile of C = A @ B on tensor cores: A is 16 x K and B is K x 8, row-major in global
// memory, K a multiple of the instruction's depth. Each lane loads exactly the elements its fragments hold
// (mma.cuh gives the layouts: g = lane / 4, t = lane % 4), so nothing is shared and nothing is staged.
#include "mma.cuh"

// TF32, m16n8k8. products = 1: each value rounded to TF32. products = 3: 3xTF32, each value split into
// big + small and the tile summed from small·big + big·small + big·big.
extern "C" __global__ void mma_tile_tf32(float* C, const float* A, const float* B, int K, int products)
{
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 8) {
        const float a_values[4] = {A[g * K + k0 + t], A[(g + 8) * K + k0 + t],
                                   A[g * K + k0 + t + 4], A[(g + 8) * K + k0 + t + 4]};
        const float b_values[2] = {B[(k0 + t) * 8 + g], B[(k0 + t + 4) * 8 + g]};
        unsigned a_big[4], a_small[4], b_big[2], b_small[2];
        for (int e = 0; e < 4; ++e) split_tf32(a_values[e], a_big[e], a_small[e]);
        for (int e = 0; e < 2; ++e) split_tf32(b_values[e], b_big[e], b_small[e]);
        if (products == 3) {
            mma_m16n8k8_tf32(d, a_small, b_big);
            mma_m16n8k8_tf32(d, a_big, b_small);
        }
        mma_m16n8k8_tf32(d, a_big, b_big);
    }
    C[g * 8 + 2 * t] = d[0];
    C[g * 8 + 2 * t + 1] = d[1];
    C[(g + 8) * 8 + 2 * t] = d[2];
    C[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// Two 16-bit values in one register, the first in the low half: how mma.sync takes bf16 operands.
__device__ __forceinline__ unsigned pack_pair(unsigned short low, unsigned short high)
{
    return (unsigned)low | ((unsigned)high << 16);
}

// bf16, m16n8k16: A and B hold bf16 values as their 16 bits. Each register carries two neighbours along k.
extern "C" __global__ void mma_tile_bf16(float* C, const unsigned short* A, const unsigned short* B, int K)
{
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int k0 = 0; k0 < K; k0 += 16) {
        const unsigned short* row = A + g * K + k0 + 2 * t;          // row g, k = k0 + 2t
        const unsigned short* row_below = A + (g + 8) * K + k0 + 2 * t;
        const unsigned a[4] = {pack_pair(row[0], row[1]), pack_pair(row_below[0], row_below[1]),
                               pack_pair(row[8], row[9]), pack_pair(row_below[8], row_below[9])};
        const unsigned short* column = B + (k0 + 2 * t) * 8 + g;      // column g, k = k0 + 2t
        const unsigned b[2] = {pack_pair(column[0], column[8]), pack_pair(column[8 * 8], column[9 * 8])};
        mma_m16n8k16_bf16(d, a, b);
    }
    C[g * 8 + 2 * t] = d[0];
    C[g * 8 + 2 * t + 1] = d[1];
    C[(g + 8) * 8 + 2 * t] = d[2];
    C[(g + 8) * 8 + 2 * t + 1] = d[3];
}
