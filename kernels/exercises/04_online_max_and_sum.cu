// The maximum m and the sum d = sum_j exp(x_j - m) of each row, reading the row once: each lane keeps a
// running (m, d) over its columns, rescaling d when a larger value arrives, then the 32 lanes' states are
// combined with shuffles: m = max(m_a, m_b), d = d_a exp(m_a - m) + d_b exp(m_b - m).
#include "warp.cuh"  // WARP_SIZE, FULL_MASK (and warp_max, warp_sum, if you prefer them)

extern "C" __global__ void online_max_and_sum(float* maximum, float* sum, const float* x, int rows, int columns)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;
    }
    const float* x_row = x + (long long)row * columns;
    float m = -3.402823466e38f, d = 0.0f;  // the lowest float: a lane with no columns adds exp(-huge) = 0
    for (int column = lane; column < columns; column += WARP_SIZE) {
        float z = x_row[column];
        if (z > m) {
            d = d * expf(m - z) + 1.0f;
            m = z;
        } else {
            d += expf(z - m);
        }
    }
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        float other_m = __shfl_xor_sync(FULL_MASK, m, offset);
        float other_d = __shfl_xor_sync(FULL_MASK, d, offset);
        float both = fmaxf(m, other_m);
        d = d * expf(m - both) + other_d * expf(other_m - both);
        m = both;
    }
    if (lane == 0) {
        maximum[row] = m;
        sum[row] = d;
    }
}
