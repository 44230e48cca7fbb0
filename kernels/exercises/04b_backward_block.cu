// dx = scale * y * (dout - <dout, y>), a block per row: the block sums dout * y (each warp with shuffles,
// then warp 0 over the warps' sums in shared memory), and every thread writes its columns. The grid may
// have more blocks than rows: those blocks do nothing.
#include "warp.cuh"  // WARP_SIZE, FULL_MASK, warp_sum

extern "C" __global__ void softmax_backward_block(float* dx, const float* dout, const float* y, int rows,
                                                  int columns, float scale)
{
    __shared__ float warp_dots[WARP_SIZE];
    __shared__ float row_dot;
    if (blockIdx.x >= rows) {
        return;  // the whole block leaves: no thread of it waits at a barrier below
    }
    long long start = (long long)blockIdx.x * columns;
    float dot = 0.0f;
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        dot += dout[start + column] * y[start + column];
    }
    dot = warp_sum(dot);
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) {
        warp_dots[warp] = dot;
    }
    __syncthreads();  // every warp's sum is in shared memory
    if (warp == 0) {
        dot = warp_sum(lane < blockDim.x / WARP_SIZE ? warp_dots[lane] : 0.0f);
        if (lane == 0) {
            row_dot = dot;
        }
    }
    __syncthreads();  // the row's dot product is in shared memory
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        dx[start + column] = scale * y[start + column] * (dout[start + column] - row_dot);
    }
}
