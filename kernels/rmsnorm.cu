// RMSNorm over the last axis of float32 rows (Llama's input_layernorm, post_attention_layernorm, norm):
//   forward:  y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), per row of C; rstd is saved per row.
//   backward: dx = rstd * (g - xhat * mean(g * xhat)), g = weight * dout, xhat = x * rstd;
//             dweight += sum over rows of dout * xhat.
// No mean is subtracted and there is no bias: LayerNorm's backward without its mean(g) term.

#include "warp.cuh"

// A warp per row, lane l on columns l, l + 32, ...: one row sum of squares, then the output.
extern "C" __global__ void rmsnorm_forward(float* y, float* rstd, const float* x, const float* weight, int rows,
                                           int columns, float eps)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const float* x_row = x + (long long)row * columns;
    float* y_row = y + (long long)row * columns;
    float squares = 0.0f;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        squares += x_row[column] * x_row[column];
    }
    float row_rstd = rsqrtf(warp_sum(squares) / columns + eps);
    for (int column = lane; column < columns; column += WARP_SIZE) {
        y_row[column] = x_row[column] * row_rstd * weight[column];
    }
    if (lane == 0) {
        rstd[row] = row_rstd;
    }
}

// dx, a warp per row: one row sum of g * xhat, then dx. dweight is left to rmsnorm_weight_gradient.
extern "C" __global__ void rmsnorm_backward(float* dx, const float* dout, const float* x, const float* weight,
                                            const float* rstd, int rows, int columns)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;
    }
    long long start = (long long)row * columns;
    float row_rstd = rstd[row];
    float g_x_hat = 0.0f;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        g_x_hat += weight[column] * dout[start + column] * x[start + column] * row_rstd;
    }
    float mean_g_x_hat = warp_sum(g_x_hat) / columns;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        float x_hat = x[start + column] * row_rstd;
        dx[start + column] = row_rstd * (weight[column] * dout[start + column] - x_hat * mean_g_x_hat);
    }
}

// dweight[c] += sum over rows of dout[row, c] * x[row, c] * rstd[row]. Blocks of (32, STRIPES) threads over 32
// columns: thread (c, s) adds rows s, s + STRIPES, ... in registers (neighbouring threads read neighbouring
// columns: coalesced), then thread (c, 0) adds the STRIPES partial sums in a fixed order. No atomics: the same
// bits on every run.
#define STRIPES 8

extern "C" __global__ void rmsnorm_weight_gradient(float* dweight, const float* dout, const float* x,
                                                   const float* rstd, int rows, int columns)
{
    __shared__ float partial[STRIPES][WARP_SIZE];
    int column = blockIdx.x * WARP_SIZE + threadIdx.x;
    float sum = 0.0f;
    if (column < columns) {
        for (int row = threadIdx.y; row < rows; row += STRIPES) {
            long long i = (long long)row * columns + column;
            sum += dout[i] * x[i] * rstd[row];
        }
    }
    partial[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y == 0 && column < columns) {
        float total = 0.0f;
        for (int stripe = 0; stripe < STRIPES; ++stripe) {
            total += partial[stripe][threadIdx.x];
        }
        dweight[column] += total;
    }
}
