// log y_i = z_i - m - log(d), a warp per row: lane l takes columns l, l + 32, ...; five shuffles give every
// lane the row's maximum, five more the sum d of exp(z - m); each lane then writes its columns.
#include "warp.cuh"  // WARP_SIZE, FULL_MASK (and warp_max, warp_sum, if you prefer them)

extern "C" __global__ void log_softmax_forward(float* out, const float* x, int rows, int columns)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const float* x_row = x + (long long)row * columns;
    float maximum = x_row[0];
    for (int column = lane; column < columns; column += WARP_SIZE) {
        maximum = fmaxf(maximum, x_row[column]);
    }
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        maximum = fmaxf(maximum, __shfl_xor_sync(FULL_MASK, maximum, offset));
    }
    float sum = 0.0f;
    for (int column = lane; column < columns; column += WARP_SIZE) {
        sum += expf(x_row[column] - maximum);
    }
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        sum += __shfl_xor_sync(FULL_MASK, sum, offset);
    }
    float log_sum = logf(sum);  // sum >= 1 (the maximum's own term): no log of 0
    for (int column = lane; column < columns; column += WARP_SIZE) {
        out[(long long)row * columns + column] = x_row[column] - maximum - log_sum;
    }
}
