// RMSNorm of one row held in registers: y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), the forward of
// kernels/rmsnorm.cu (rmsnorm_forward_registers) and of the GEMV that norms its own output in its last block
// (kernels/gemv.cu), so that both give the same bits. The row's ROW_THREADS = WARPS_PER_ROW x 32 threads are
// consecutive threads of the block: thread t holds the K groups of WIDTH neighbouring columns that start at
// (t + ROW_THREADS k) WIDTH, k < K. The sum of squares: each thread adds its K WIDTH squares in order, each warp
// by warp_sum's butterfly, then the row's warps by one more butterfly over the warps' sums (zeros past them) —
// warp.cuh's block_sum order, in a block that holds one row or several.
#ifndef GPT2_CUPY_RMSNORM_ROW_CUH
#define GPT2_CUPY_RMSNORM_ROW_CUH

#include "storage.cuh"
#include "warp.cuh"

// The sum over the row's threads, in each of them. WARPS_PER_ROW > 1: every thread of the block must call it
// (it waits at __syncthreads), the block's warps taken WARPS_PER_ROW at a time as rows.
template <int WARPS_PER_ROW>
__device__ __forceinline__ float row_threads_sum(float value)
{
    value = warp_sum(value);
    if (WARPS_PER_ROW == 1) {
        return value;
    }
    __shared__ float warp_sums[WARP_SIZE];
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    if (lane == 0) {
        warp_sums[warp] = value;
    }
    __syncthreads();
    float partial = lane < WARPS_PER_ROW ? warp_sums[warp - warp % WARPS_PER_ROW + lane] : 0.0f;
    __syncthreads();  // every warp has read the sums before a next call writes them
    return warp_sum(partial);
}

// WIDTH elements written by other blocks of this launch, as floats (zeros when not inside): __ldcg reads through
// the L2 cache, where every multiprocessor's writes meet, never from this multiprocessor's L1 (not kept
// coherent). One load of the whole group where it is 8 or 16 bytes.
template <int WIDTH, typename floatX>
__device__ __forceinline__ void load_as_float_from_l2(float* destination, const floatX* source, bool inside)
{
    if (!inside) {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = 0.0f;
        }
    } else if (WIDTH * sizeof(floatX) == 16) {
        uint4 group = __ldcg(reinterpret_cast<const uint4*>(source));
        const floatX* elements = reinterpret_cast<const floatX*>(&group);
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = to_float(elements[w]);
        }
    } else if (WIDTH * sizeof(floatX) == 8) {
        uint2 group = __ldcg(reinterpret_cast<const uint2*>(source));
        const floatX* elements = reinterpret_cast<const floatX*>(&group);
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = to_float(elements[w]);
        }
    } else {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = to_float(__ldcg(source + w));
        }
    }
}

// y_row = RMSNorm(x_row) * weight for the row of this thread's ROW_THREADS; returns rstd (in every thread of the
// row). x and y float32 or bf16 (floatX), weight float32 or bf16 (weightT); the sum and rstd in float32, y
// rounded once. inside = false: a row past the last, which reads and writes nothing but still takes part in
// row_threads_sum's barriers. X_FROM_L2: x was written by other blocks of this launch (the GEMV's last block).
// The row's x and weight loads are all issued before any is used: one round trip to memory.
template <int WIDTH, int K, int WARPS_PER_ROW, bool X_FROM_L2, typename floatX, typename weightT>
__device__ __forceinline__ float rmsnorm_row(floatX* y_row, const floatX* x_row, const weightT* weight, int columns,
                                             float eps, bool inside)
{
    constexpr int ROW_THREADS = WARPS_PER_ROW * WARP_SIZE;
    int thread = threadIdx.x % ROW_THREADS;
    float values[K * WIDTH], scale[K * WIDTH];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (thread + k * ROW_THREADS) * WIDTH;
        bool loaded = inside && column < columns;
        if (X_FROM_L2) {
            load_as_float_from_l2<WIDTH>(values + k * WIDTH, x_row + column, loaded);
        } else {
            load_as_float<WIDTH>(values + k * WIDTH, x_row + column, loaded);
        }
        load_as_float<WIDTH>(scale + k * WIDTH, weight + column, loaded);
    }
    float squares = 0.0f;
#pragma unroll
    for (int i = 0; i < K * WIDTH; ++i) {
        squares += values[i] * values[i];
    }
    float rstd = rsqrtf(row_threads_sum<WARPS_PER_ROW>(squares) / columns + eps);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (thread + k * ROW_THREADS) * WIDTH;
        if (inside && column < columns) {
            float result[WIDTH];
#pragma unroll
            for (int w = 0; w < WIDTH; ++w) {
                result[w] = values[k * WIDTH + w] * rstd * scale[k * WIDTH + w];
            }
            store_from_float<WIDTH>(y_row + column, result);
        }
    }
    return rstd;
}

#endif
