// RMSNorm over the last axis of float32 rows (Llama's input_layernorm, post_attention_layernorm, norm):
//   forward:  y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), per row of C; rstd is saved per row.
//   backward: dx = rstd * (g - xhat * mean(g * xhat)), g = weight * dout, xhat = x * rstd;
//             dweight += sum over rows of dout * xhat.
// No mean is subtracted and there is no bias: LayerNorm's backward without its mean(g) term.
//
// Two versions. First, chapter 05's first layout: a warp per row, lane l on columns l, l + 32, ..., the row
// read twice (once for the sum of squares, once for the output), and dweight from a second kernel that
// reads dout and x again. Then the version the op launches (..._registers), chapter 05's LayerNorm layout: the
// row held in registers, read from memory once, four floats per load, and dweight summed on the way.
// bench/llama.py times both at Llama 7B's width, C = 4096.

#include "dependent_launch.cuh"
#include "float_groups.cuh"
#include "rmsnorm_row.cuh"
#include "storage.cuh"
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

// ---- The row in registers ----------------------------------------------------------------------------------
// A row is shared by WARPS_PER_ROW warps, ROW_THREADS threads: thread t of the row holds the K groups of WIDTH
// neighbouring columns that start at (t + ROW_THREADS k) WIDTH, k < K (WIDTH = 4: one float4 load each; the
// op picks it when C is a multiple of 4 and the arrays start on 16 bytes). K WIDTH <= 16 floats per thread,
// so that x, dout, weight and dweight all stay in registers: C = 4096 takes 8 warps per row, 4 float4s each.
// Launch with C <= ROW_THREADS K WIDTH. One warp per row: blocks of 8 warps, 8 rows; more: one row per block,
// its warps' sums added by row_threads_sum (rmsnorm_row.cuh, in block_sum's order).

// x and y float32 or bf16 (floatX), weight float32 or bf16 (weightT, a model converted to bf16 for generation):
// read into floats, the sum of squares and rstd in float32, y rounded once. The row's arithmetic is
// rmsnorm_row (rmsnorm_row.cuh), which the GEMV also runs on its own output in generation (kernels/gemv.cu).
template <int WIDTH, int K, int WARPS_PER_ROW, typename floatX = float, typename weightT = float>
__global__ void rmsnorm_forward_registers(floatX* y, float* rstd, const floatX* x, const weightT* weight, int rows,
                                          int columns, float eps)
{
    let_next_kernel_start();      // launched dependent (dependent_launch.cuh): in generation the product after
    wait_for_previous_kernel();   // this norm starts its weight loads while it runs; x is the kernel before's
    int row = WARPS_PER_ROW == 1 ? (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE : blockIdx.x;
    if (row >= rows) {
        return;  // only where a warp is a row (a block of several rows): its lanes leave together
    }
    long long start = (long long)row * columns;
    float row_rstd = rmsnorm_row<WIDTH, K, WARPS_PER_ROW, false>(y + start, x + start, weight, columns, eps, true);
    if (threadIdx.x % (WARPS_PER_ROW * WARP_SIZE) == 0) {
        rstd[row] = row_rstd;
    }
}

// dx, and dweight's partial sums. A block is one row's ROW_THREADS threads; it walks rows
// [b rows_per_block, (b + 1) rows_per_block), each thread adding its columns' dout * xhat over them in
// registers (its columns are the same in every row: nothing to share), and writes them as row b of
// weight_partials (blocks, columns); column_sums_accumulate (layernorm.cu) then adds the rows into dweight in
// a fixed order. rows_per_block is a fixed number, so that every sum has the same order on any GPU.
template <int WIDTH, int K, int WARPS_PER_ROW>
__global__ void rmsnorm_backward_registers(float* dx, float* weight_partials, const float* dout, const float* x,
                                           const float* weight, const float* rstd, int rows, int columns,
                                           int rows_per_block)
{
    constexpr int ROW_THREADS = WARPS_PER_ROW * WARP_SIZE;
    int thread = threadIdx.x;
    float scale[K * WIDTH], dweight[K * WIDTH];
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (thread + k * ROW_THREADS) * WIDTH;
        load_group<WIDTH>(scale + k * WIDTH, weight + column, column < columns);
#pragma unroll
        for (int w = 0; w < WIDTH; ++w) {
            dweight[k * WIDTH + w] = 0.0f;
        }
    }
    int first = blockIdx.x * rows_per_block;
    int last = min(first + rows_per_block, rows);
    for (int row = first; row < last; ++row) {
        long long start = (long long)row * columns;
        float row_rstd = rstd[row];
        float x_hat[K * WIDTH], d[K * WIDTH];
#pragma unroll
        for (int k = 0; k < K; ++k) {  // only loads: the row's 2 K loads in flight together
            int column = (thread + k * ROW_THREADS) * WIDTH;
            load_group<WIDTH>(x_hat + k * WIDTH, x + start + column, column < columns);
            load_group<WIDTH>(d + k * WIDTH, dout + start + column, column < columns);
        }
        float g_x_hat = 0.0f;
#pragma unroll
        for (int i = 0; i < K * WIDTH; ++i) {
            x_hat[i] *= row_rstd;
            g_x_hat += scale[i] * d[i] * x_hat[i];   // 0 past the row's end, where d is 0
            dweight[i] += d[i] * x_hat[i];
        }
        float mean_g_x_hat = row_threads_sum<WARPS_PER_ROW>(g_x_hat) / columns;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int column = (thread + k * ROW_THREADS) * WIDTH;
            if (column < columns) {
                float result[WIDTH];
#pragma unroll
                for (int w = 0; w < WIDTH; ++w) {
                    int i = k * WIDTH + w;
                    result[w] = row_rstd * (scale[i] * d[i] - x_hat[i] * mean_g_x_hat);
                }
                store_group<WIDTH>(dx + start + column, result);
            }
        }
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (thread + k * ROW_THREADS) * WIDTH;
        if (column < columns) {
            store_group<WIDTH>(weight_partials + (long long)blockIdx.x * columns + column, dweight + k * WIDTH);
        }
    }
}
