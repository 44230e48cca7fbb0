// LayerNorm forward, second version: a warp per row, the row read once into registers. Lane l holds
// columns l, l + 32, ..., l + 32 (K - 1) in values[K]; K is a template parameter, so the loops unroll and
// values stays in registers. Both reductions and the output come from there; columns past the row's end
// hold 0 and are left out of the variance.
#include "warp.cuh"

template <int K>
__global__ void layernorm_forward_registers(float* y, float* mean, float* rstd, const float* x, const float* weight,
                                            const float* bias, int rows, int columns, float eps)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;
    }
    const float* x_row = x + (long long)row * columns;
    float values[K];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {  // K loads in flight: none waits for another
        int column = lane + k * WARP_SIZE;
        values[k] = column < columns ? x_row[column] : 0.0f;
        sum += values[k];
    }
    float row_mean = warp_sum(sum) / columns;
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        float deviation = lane + k * WARP_SIZE < columns ? values[k] - row_mean : 0.0f;
        squares += deviation * deviation;
    }
    float row_rstd = rsqrtf(warp_sum(squares) / columns + eps);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = lane + k * WARP_SIZE;
        if (column < columns) {
            y[(long long)row * columns + column] = (values[k] - row_mean) * row_rstd * weight[column] + bias[column];
        }
    }
    if (lane == 0) {
        mean[row] = row_mean;
        rstd[row] = row_rstd;
    }
}
