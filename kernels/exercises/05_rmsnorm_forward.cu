// y = weight * x / sqrt(mean(x^2) + eps), a warp per row: one row sum of squares by shuffles.
#include "warp.cuh"  // WARP_SIZE, FULL_MASK (and warp_max, warp_sum, if you prefer them)

extern "C" __global__ void rmsnorm_forward(float* y, const float* x, const float* weight, int rows, int columns,
                                           float eps)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;
    }
    const float* x_row = x + (long long)row * columns;
    float squares = 0.0f;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        squares += x_row[column] * x_row[column];
    }
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        squares += __shfl_xor_sync(FULL_MASK, squares, offset);
    }
    float scale = rsqrtf(squares / columns + eps);
    for (int column = lane; column < columns; column += WARP_SIZE) {
        y[(long long)row * columns + column] = x_row[column] * scale * weight[column];
    }
}
