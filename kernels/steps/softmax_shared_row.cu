// Softmax for long rows, a block per row, the row kept in shared memory: global memory sees x read once
// and y written once. Each thread runs the online (maximum, sum) over its columns while it copies them into
// shared memory; the block combines the states; then each thread writes y from its columns in shared memory.
// Launch with blockDim.x a multiple of 32 and shared_mem = 4 * columns bytes.
#include "warp.cuh"
#include "special_values.cuh"

struct MaxSum {
    float maximum;
    float sum;  // of exp(z - maximum)
};

__device__ MaxSum combine(MaxSum a, MaxSum b)
{
    float maximum = fmaxf(a.maximum, b.maximum);
    if (maximum == NEGATIVE_INFINITY) {
        return a;  // both empty: exp(-inf - (-inf)) would be NaN
    }
    MaxSum both = {maximum, a.sum * expf(a.maximum - maximum) + b.sum * expf(b.maximum - maximum)};
    return both;
}

extern "C" __global__ void softmax_forward_shared_row(float* y, const float* x, int columns)
{
    extern __shared__ float row_cache[];  // the row, columns floats
    __shared__ MaxSum warp_states[WARP_SIZE];
    const float* x_row = x + (long long)blockIdx.x * columns;
    float* y_row = y + (long long)blockIdx.x * columns;

    MaxSum state = {NEGATIVE_INFINITY, 0.0f};
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        float z = x_row[column];
        row_cache[column] = z;
        MaxSum one = {z, 1.0f};
        state = combine(state, one);
    }
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {  // the warp's 32 states, a butterfly
        MaxSum other = {__shfl_xor_sync(FULL_MASK, state.maximum, offset), __shfl_xor_sync(FULL_MASK, state.sum, offset)};
        state = combine(state, other);
    }
    if (threadIdx.x % WARP_SIZE == 0) {
        warp_states[threadIdx.x / WARP_SIZE] = state;
    }
    __syncthreads();  // every warp's state written
    MaxSum total = {NEGATIVE_INFINITY, 0.0f};
    for (int warp = 0; warp < blockDim.x / WARP_SIZE; ++warp) {  // every thread, in the same order
        total = combine(total, warp_states[warp]);
    }
    float inverse_sum = 1.0f / total.sum;
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {  // the columns this thread stored
        y_row[column] = expf(row_cache[column] - total.maximum) * inverse_sum;
    }
}
