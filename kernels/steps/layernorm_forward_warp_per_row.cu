// LayerNorm forward, first version: a warp per row, one float per load, the row walked three times in
// memory (the sum, the squared deviations, the output): the second and third walks hit the L1 or L2 cache
// when they are lucky. No bias (the package's kernel has it).
#include "warp.cuh"

extern "C" __global__ void layernorm_forward_warp_per_row(float* y, float* mean, float* rstd, const float* x,
                                                          const float* weight, int rows, int columns, float eps)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;
    }
    const float* x_row = x + (long long)row * columns;
    float sum = 0.0f;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        sum += x_row[column];
    }
    float row_mean = warp_sum(sum) / columns;
    float squares = 0.0f;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        float deviation = x_row[column] - row_mean;
        squares += deviation * deviation;
    }
    float row_rstd = rsqrtf(warp_sum(squares) / columns + eps);
    for (int column = lane; column < columns; column += WARP_SIZE) {
        y[(long long)row * columns + column] = (x_row[column] - row_mean) * row_rstd * weight[column];
    }
    if (lane == 0) {
        mean[row] = row_mean;
        rstd[row] = row_rstd;
    }
}
