// Softmax, third version: a warp per row, the row read once into registers. Lane l holds columns
// l, l + 32, ..., l + 32 (K - 1) in z[K]; K is a template parameter, so the loops unroll and z stays in
// registers. No load depends on another, so all K are in flight before the first is used.
#include "warp.cuh"
#include "special_values.cuh"

template <int K>
__global__ void softmax_forward_warp_registers(float* y, const float* x, int rows, int columns)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;  // the whole warp leaves together
    }
    const float* x_row = x + (long long)row * columns;
    float* y_row = y + (long long)row * columns;
    float z[K];
    float maximum = NEGATIVE_INFINITY;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = lane + k * WARP_SIZE;
        z[k] = column < columns ? x_row[column] : NEGATIVE_INFINITY;  // past the end: adds nothing
        maximum = fmaxf(maximum, z[k]);
    }
    maximum = warp_max(maximum);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        z[k] = expf(z[k] - maximum);
        sum += z[k];
    }
    float inverse_sum = 1.0f / warp_sum(sum);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = lane + k * WARP_SIZE;
        if (column < columns) {
            y_row[column] = z[k] * inverse_sum;
        }
    }
}
