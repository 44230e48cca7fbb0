// dx = rstd (g - mean(g) - x_hat mean(g x_hat)), g = weight dout, x_hat = (x - mean) rstd: a warp per row,
// both row means in one pass over the row, then a second pass that writes dx.
#include "warp.cuh"  // WARP_SIZE, FULL_MASK (and warp_max, warp_sum, if you prefer them)

extern "C" __global__ void layernorm_backward_dx(float* dx, const float* dout, const float* x, const float* weight,
                                                 const float* mean, const float* rstd, int rows, int columns)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;
    }
    long long start = (long long)row * columns;
    float row_mean = mean[row], row_rstd = rstd[row];
    float g_sum = 0.0f, g_x_hat_sum = 0.0f;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        float g = weight[column] * dout[start + column];
        g_sum += g;
        g_x_hat_sum += g * (x[start + column] - row_mean) * row_rstd;
    }
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        g_sum += __shfl_xor_sync(FULL_MASK, g_sum, offset);
        g_x_hat_sum += __shfl_xor_sync(FULL_MASK, g_x_hat_sum, offset);
    }
    float g_mean = g_sum / columns, g_x_hat_mean = g_x_hat_sum / columns;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        float x_hat = (x[start + column] - row_mean) * row_rstd;
        float g = weight[column] * dout[start + column];
        dx[start + column] = row_rstd * (g - g_mean - x_hat * g_x_hat_mean);
    }
}
