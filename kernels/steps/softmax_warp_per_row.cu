// Softmax, second version: a warp per row. The 32 lanes read neighbouring elements (one 128-byte line per
// load of the warp), each keeps a partial maximum and a partial sum, and warp_max and warp_sum (five
// __shfl_xor_sync steps each) combine the 32 partials so that every lane holds the row's result. The row is
// still read three times: the second and third passes find it in the L1 or L2 cache only if it is short and
// recent enough.
#include "warp.cuh"

extern "C" __global__ void softmax_forward_warp_per_row(float* y, const float* x, int rows, int columns)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const float* x_row = x + (long long)row * columns;
    float* y_row = y + (long long)row * columns;

    float maximum = x_row[0];
    for (int column = lane; column < columns; column += WARP_SIZE) {
        maximum = fmaxf(maximum, x_row[column]);
    }
    maximum = warp_max(maximum);
    float sum = 0.0f;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        sum += expf(x_row[column] - maximum);
    }
    sum = warp_sum(sum);
    for (int column = lane; column < columns; column += WARP_SIZE) {
        y_row[column] = expf(x_row[column] - maximum) / sum;
    }
}
