// Softmax of long rows, a block per row: each thread runs the online (m, d) over its columns, the warps
// combine their lanes' states with shuffles, warp 0's lanes take the warps' states from shared memory and
// combine them, and every thread reads the row's (m, d) back to write its columns of y. The grid may have
// more blocks than rows: those blocks do nothing.
#include "warp.cuh"  // WARP_SIZE, FULL_MASK, warp_max, warp_sum

#define LOWEST_FLOAT (-3.402823466e38f)

__device__ void merge_state(float& m, float& d, float other_m, float other_d)
{
    float both = fmaxf(m, other_m);
    d = d * expf(m - both) + other_d * expf(other_m - both);
    m = both;
}

extern "C" __global__ void softmax_online_block(float* y, const float* x, int rows, int columns)
{
    __shared__ float warp_maxima[WARP_SIZE], warp_sums[WARP_SIZE];
    __shared__ float row_maximum, row_sum;
    if (blockIdx.x >= rows) {
        return;  // the whole block leaves: no thread of it waits at a barrier below
    }
    const float* x_row = x + (long long)blockIdx.x * columns;
    float m = LOWEST_FLOAT, d = 0.0f;
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        merge_state(m, d, x_row[column], 1.0f);
    }
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        merge_state(m, d, __shfl_xor_sync(FULL_MASK, m, offset), __shfl_xor_sync(FULL_MASK, d, offset));
    }
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) {
        warp_maxima[warp] = m;
        warp_sums[warp] = d;
    }
    __syncthreads();  // every warp's state is in shared memory
    if (warp == 0) {
        m = lane < blockDim.x / WARP_SIZE ? warp_maxima[lane] : LOWEST_FLOAT;
        d = lane < blockDim.x / WARP_SIZE ? warp_sums[lane] : 0.0f;
        for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
            merge_state(m, d, __shfl_xor_sync(FULL_MASK, m, offset), __shfl_xor_sync(FULL_MASK, d, offset));
        }
        if (lane == 0) {
            row_maximum = m;
            row_sum = d;
        }
    }
    __syncthreads();  // the row's state is in shared memory
    float inverse_sum = 1.0f / row_sum;
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        y[(long long)blockIdx.x * columns + column] = expf(x_row[column] - row_maximum) * inverse_sum;
    }
}
