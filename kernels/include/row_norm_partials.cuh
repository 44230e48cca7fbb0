// The backward of a norm over the last axis (LayerNorm, DyT) sums its weight and bias gradients over the
// rows. Each warp of a block holds the sums of its rows in registers, dweight and dbias, for the K groups of
// WIDTH columns that start at (lane + 32 k) WIDTH, as the kernels walk a row. block_column_partials adds the
// warps' sums into shared memory one warp after the other (a fixed order: the same sums on every run, and no
// atomics), then writes them as row blockIdx.x of weight_partials and bias_partials, (gridDim.x, columns)
// arrays whose rows a second kernel adds up. weight_sums and bias_sums: columns floats of shared memory each.
// Every thread of the block must call it: it waits at __syncthreads.
#ifndef GPT2_CUPY_ROW_NORM_PARTIALS_CUH
#define GPT2_CUPY_ROW_NORM_PARTIALS_CUH

#include "float_groups.cuh"
#include "warp.cuh"

// The start of such a backward: a lane's K groups of the weight in scale (zeros past the row's end), for the
// kernel's own use, and its sums dweight and dbias set to zero.
template <int K, int WIDTH>
__device__ __forceinline__ void begin_column_partials(float* scale, float* dweight, float* dbias, const float* weight,
                                                      int columns)
{
    int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
        load_group<WIDTH>(scale + k * WIDTH, weight + column, column < columns);
#pragma unroll
        for (int w = 0; w < WIDTH; ++w) {
            dweight[k * WIDTH + w] = 0.0f;
            dbias[k * WIDTH + w] = 0.0f;
        }
    }
}

template <int K, int WIDTH>
__device__ __forceinline__ void block_column_partials(const float* dweight, const float* dbias, float* weight_sums,
                                                      float* bias_sums, float* weight_partials, float* bias_partials,
                                                      int columns)
{
    int warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    for (int turn = 0; turn < warps; ++turn) {
        if (warp == turn) {
#pragma unroll
            for (int k = 0; k < K; ++k) {
                int column = (lane + k * WARP_SIZE) * WIDTH;
                if (column < columns) {
#pragma unroll
                    for (int w = 0; w < WIDTH; ++w) {
                        int i = k * WIDTH + w;
                        weight_sums[column + w] = turn == 0 ? dweight[i] : weight_sums[column + w] + dweight[i];
                        bias_sums[column + w] = turn == 0 ? dbias[i] : bias_sums[column + w] + dbias[i];
                    }
                }
            }
        }
        __syncthreads();
    }
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        weight_partials[(long long)blockIdx.x * columns + column] = weight_sums[column];
        bias_partials[(long long)blockIdx.x * columns + column] = bias_sums[column];
    }
}

#endif
