// DyT, Dynamic Tanh (Zhu, Chen, He, LeCun and Liu, 2025), a replacement for LayerNorm without row statistics:
//   forward:  y = weight * tanh(alpha * x) + bias, alpha one learnable number (alpha[0], on the device);
//   backward: with t = tanh(alpha x) and t' = 1 - t^2,
//             dx = dout * weight * alpha * t',  dalpha += sum over all elements of dout * weight * x * t',
//             dweight += sum over rows of dout * t,  dbias += sum over rows of dout.
// Rows of C = columns floats. The forward is elementwise; the backward keeps a lane on the same columns
// for every row it handles, so that the column sums build up in registers (layernorm.cu's layout).

#include "warp.cuh"
#include "float_groups.cuh"
#include "row_norm_partials.cuh"

// One thread per element.
extern "C" __global__ void dyt_forward(float* y, const float* x, const float* alpha, const float* weight,
                                       const float* bias, int n, int columns, int has_bias)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        int column = i % columns;
        y[i] = weight[column] * tanhf(alpha[0] * x[i]) + (has_bias ? bias[column] : 0.0f);
    }
}

// Four elements per thread through 16-byte loads: columns a multiple of 4 (so the four share a row, and n is
// a multiple of 4), arrays 16-byte aligned. Launch n / 4 threads.
extern "C" __global__ void dyt_forward_float4(float* y, const float* x, const float* alpha, const float* weight,
                                              const float* bias, int n, int columns, int has_bias)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * i < n) {
        int column = (4 * i) % columns;
        float a = alpha[0];
        float4 v = reinterpret_cast<const float4*>(x)[i];
        float4 w = *reinterpret_cast<const float4*>(weight + column);
        float4 b = has_bias ? *reinterpret_cast<const float4*>(bias + column) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        reinterpret_cast<float4*>(y)[i] = make_float4(w.x * tanhf(a * v.x) + b.x, w.y * tanhf(a * v.y) + b.y,
                                                      w.z * tanhf(a * v.z) + b.z, w.w * tanhf(a * v.w) + b.w);
    }
}

// Block b handles rows [b rows_per_block, (b + 1) rows_per_block), a warp per row, lane `lane` on the groups
// of WIDTH columns that start at (lane + 32 k) WIDTH. It writes one row of partial dweight and dbias sums and
// one partial dalpha, each added up in a fixed order (warps one after the other), so that the results are
// the same on every run. Dynamic shared memory: 2 * columns floats.
template <int WIDTH, int K>
__global__ void dyt_backward(float* dx, float* weight_partials, float* bias_partials, float* alpha_partials,
                             const float* dout, const float* x, const float* alpha, const float* weight,
                             int rows, int columns, int rows_per_block)
{
    extern __shared__ float shared[];
    float* weight_sums = shared;
    float* bias_sums = shared + columns;
    __shared__ float alpha_sums[WARP_SIZE];
    int warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    float a = alpha[0];

    float scale[K * WIDTH], dweight[K * WIDTH], dbias[K * WIDTH];
    begin_column_partials<K, WIDTH>(scale, dweight, dbias, weight, columns);
    float dalpha = 0.0f;

    int first = blockIdx.x * rows_per_block;
    int last = min(first + rows_per_block, rows);
    for (int row = first + warp; row < last; row += warps) {
        long long start = (long long)row * columns;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int column = (lane + k * WARP_SIZE) * WIDTH;
            float v[WIDTH], d[WIDTH], result[WIDTH];
            load_group<WIDTH>(v, x + start + column, column < columns);
            load_group<WIDTH>(d, dout + start + column, column < columns);
#pragma unroll
            for (int w = 0; w < WIDTH; ++w) {
                int i = k * WIDTH + w;
                float t = tanhf(a * v[w]);
                float g = d[w] * scale[i] * (1.0f - t * t);  // dout * weight * tanh'(alpha x); 0 past the row
                result[w] = g * a;
                dalpha += g * v[w];
                dweight[i] += d[w] * t;
                dbias[i] += d[w];
            }
            if (column < columns) {
                store_group<WIDTH>(dx + start + column, result);
            }
        }
    }

    dalpha = warp_sum(dalpha);
    if (lane == 0) {
        alpha_sums[warp] = dalpha;
    }
    block_column_partials<K, WIDTH>(dweight, dbias, weight_sums, bias_sums, weight_partials, bias_partials, columns);
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < warps; ++w) {
            total += alpha_sums[w];
        }
        alpha_partials[blockIdx.x] = total;
    }
}

// WIDTH floats written by other blocks of this launch: __ldcg reads through the L2 cache, where every
// multiprocessor's writes meet, never from this multiprocessor's own L1 (which is not kept coherent).
template <int WIDTH>
__device__ __forceinline__ void load_group_from_l2(float* destination, const float* source)
{
    if (WIDTH == 4) {
        float4 group = __ldcg(reinterpret_cast<const float4*>(source));
        destination[0] = group.x;
        destination[1] = group.y;
        destination[2] = group.z;
        destination[3] = group.w;
    } else {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = __ldcg(source + w);
        }
    }
}

// The backward as an elementwise kernel with column sums: no row needs reducing, so a thread owns one group
// of WIDTH columns and walks down the rows. Blocks of (32, ROW_SLOTS) threads; block (i, j) covers the
// column groups 32 i .. 32 i + 31 and the rows [j rows_per_block, (j + 1) rows_per_block), thread (x, y)
// every ROW_SLOTS-th of those rows from the y-th. A warp (a fixed y) reads 32 neighbouring groups of a row:
// 512 contiguous bytes for WIDTH = 4. dweight, dbias and dalpha build up in registers, 2 WIDTH + 1 floats.
//
// Then, with a fixed order at every step (so the same bits on every run, whichever block finishes last):
//   1. the block adds its ROW_SLOTS rows of sums in shared memory, y = 0, 1, ...; it writes one row of
//      partial dweight and dbias for its columns, and one partial dalpha;
//   2. the last block of a column stripe to finish (a counter per stripe, counters[i]) adds the stripe's
//      partial rows, j = 0, 1, ..., into dweight and dbias, and sets its counter back to 0;
//   3. the last stripe to finish (counters[gridDim.x]) adds all blocks' dalpha partials, in a fixed order.
// "Last" is known from atomicAdd's return value; __threadfence() before it makes a block's partial sums
// visible to every other block before its count is. counters: gridDim.x + 1 zeros before the launch (and
// after it). Partials: weight_partials and bias_partials (gridDim.y, columns), alpha_partials gridDim.x
// gridDim.y floats. Launch with blockDim (32, ROW_SLOTS).
//
// ROWS_AT_ONCE: a thread loads that many of its rows (x and dout, 2 ROWS_AT_ONCE groups) before it computes
// any of them. With one row at a time, the store of dx between two rows keeps the compiler from moving the
// next row's loads above it (dx could be the same memory as x or dout, as far as it knows): two loads in
// flight per thread, too few to cover the memory's latency. The rows are still added in the same order
// (row, row + ROW_SLOTS, ...), so the sums are the same bits for any ROWS_AT_ONCE.
template <int WIDTH, int ROW_SLOTS, int ROWS_AT_ONCE>
__global__ void __launch_bounds__(WARP_SIZE * ROW_SLOTS)
dyt_backward_columns(float* dx, float* dalpha_sum, float* dweight_sum, float* dbias_sum, float* weight_partials,
                     float* bias_partials, float* alpha_partials, unsigned int* counters, const float* dout,
                     const float* x, const float* alpha, const float* weight, int rows, int columns,
                     int rows_per_block, int has_bias)
{
    __shared__ float weight_slots[ROW_SLOTS][WARP_SIZE * WIDTH];
    __shared__ float bias_slots[ROW_SLOTS][WARP_SIZE * WIDTH];
    __shared__ float alpha_slots[ROW_SLOTS][WARP_SIZE];
    __shared__ bool last;
    int group = threadIdx.x, slot = threadIdx.y;
    int column = (blockIdx.x * WARP_SIZE + group) * WIDTH;
    bool inside = column < columns;
    float a = alpha[0];

    float scale[WIDTH], dweight[WIDTH], dbias[WIDTH];
    float dalpha = 0.0f;
    load_group<WIDTH>(scale, weight + column, inside);
    for (int w = 0; w < WIDTH; ++w) {
        dweight[w] = 0.0f;
        dbias[w] = 0.0f;
    }
    int first = blockIdx.y * rows_per_block;
    int last_row = min(first + rows_per_block, rows);
    if (inside) {
        for (int row = first + slot; row < last_row; row += ROWS_AT_ONCE * ROW_SLOTS) {
            // All loads first: 2 ROWS_AT_ONCE loads in flight per thread (past the block's rows: zeros).
            float v[ROWS_AT_ONCE][WIDTH], d[ROWS_AT_ONCE][WIDTH];
#pragma unroll
            for (int r = 0; r < ROWS_AT_ONCE; ++r) {
                long long start = (long long)(row + r * ROW_SLOTS) * columns + column;
                bool present = row + r * ROW_SLOTS < last_row;
                load_group<WIDTH>(v[r], x + start, present);
                load_group<WIDTH>(d[r], dout + start, present);
            }
            // Then the arithmetic and the stores, row after row in the same order as the loads.
#pragma unroll
            for (int r = 0; r < ROWS_AT_ONCE; ++r) {
                if (row + r * ROW_SLOTS < last_row) {
                    float result[WIDTH];
#pragma unroll
                    for (int w = 0; w < WIDTH; ++w) {
                        float t = tanhf(a * v[r][w]);
                        float g = d[r][w] * scale[w] * (1.0f - t * t);  // dout * weight * tanh'(alpha x)
                        result[w] = g * a;
                        dalpha += g * v[r][w];
                        dweight[w] += d[r][w] * t;
                        dbias[w] += d[r][w];
                    }
                    store_group<WIDTH>(dx + (long long)(row + r * ROW_SLOTS) * columns + column, result);
                }
            }
        }
    }

    // 1. The block's row slots, added in order y = 0, 1, ...
    for (int w = 0; w < WIDTH; ++w) {
        weight_slots[slot][group * WIDTH + w] = dweight[w];
        bias_slots[slot][group * WIDTH + w] = dbias[w];
    }
    alpha_slots[slot][group] = dalpha;
    __syncthreads();
    long long partial_row = (long long)blockIdx.y * columns;
    for (int i = slot * WARP_SIZE + group; i < WARP_SIZE * WIDTH; i += WARP_SIZE * ROW_SLOTS) {
        float weight_total = 0.0f, bias_total = 0.0f;
        for (int s = 0; s < ROW_SLOTS; ++s) {
            weight_total += weight_slots[s][i];
            bias_total += bias_slots[s][i];
        }
        int c = blockIdx.x * WARP_SIZE * WIDTH + i;
        if (c < columns) {
            weight_partials[partial_row + c] = weight_total;
            bias_partials[partial_row + c] = bias_total;
        }
    }
    if (slot == 0) {  // warp 0: each lane adds a column of alpha_slots, then the fixed butterfly of warp_sum
        float total = 0.0f;
        for (int s = 0; s < ROW_SLOTS; ++s) {
            total += alpha_slots[s][group];
        }
        total = warp_sum(total);
        if (group == 0) {
            alpha_partials[blockIdx.y * gridDim.x + blockIdx.x] = total;
        }
    }
    __threadfence();  // each thread's partial sums reach memory before the count says they are there
    __syncthreads();
    if (slot == 0 && group == 0) {
        last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }

    // 2. The stripe's last block: thread (x, y) adds the partial rows j = y, y + ROW_SLOTS, ... of its own
    //    columns (WIDTH floats per load, many loads in flight), then the block adds its ROW_SLOTS results in
    //    order y = 0, 1, ..., as in step 1: a fixed order whichever block does it.
    for (int w = 0; w < WIDTH; ++w) {
        dweight[w] = 0.0f;
        dbias[w] = 0.0f;
    }
    if (inside) {
#pragma unroll 4
        for (int j = slot; j < (int)gridDim.y; j += ROW_SLOTS) {
            float weight_part[WIDTH], bias_part[WIDTH];
            load_group_from_l2<WIDTH>(weight_part, weight_partials + (long long)j * columns + column);
            load_group_from_l2<WIDTH>(bias_part, bias_partials + (long long)j * columns + column);
            for (int w = 0; w < WIDTH; ++w) {
                dweight[w] += weight_part[w];
                dbias[w] += bias_part[w];
            }
        }
    }
    for (int w = 0; w < WIDTH; ++w) {
        weight_slots[slot][group * WIDTH + w] = dweight[w];
        bias_slots[slot][group * WIDTH + w] = dbias[w];
    }
    __syncthreads();
    for (int i = slot * WARP_SIZE + group; i < WARP_SIZE * WIDTH; i += WARP_SIZE * ROW_SLOTS) {
        int c = blockIdx.x * WARP_SIZE * WIDTH + i;
        if (c < columns) {
            float weight_total = 0.0f, bias_total = 0.0f;
            for (int s = 0; s < ROW_SLOTS; ++s) {
                weight_total += weight_slots[s][i];
                bias_total += bias_slots[s][i];
            }
            dweight_sum[c] += weight_total;  // add, not set: a parameter's gradient accumulates
            if (has_bias) {
                dbias_sum[c] += bias_total;
            }
        }
    }
    __threadfence();  // the gradients written before the stripe counts as finished
    __syncthreads();
    if (slot == 0 && group == 0) {
        counters[blockIdx.x] = 0;  // ready for the next launch
        last = atomicAdd(&counters[gridDim.x], 1u) == gridDim.x - 1;
    }
    __syncthreads();
    // 3. The last stripe: dalpha, every block's partial; lane l adds parts l, l + 32, ..., then warp_sum.
    if (last && slot == 0) {
        int parts = gridDim.x * gridDim.y;
        float total = 0.0f;
        for (int p = group; p < parts; p += WARP_SIZE) {
            total += __ldcg(alpha_partials + p);
        }
        total = warp_sum(total);
        if (group == 0) {
            dalpha_sum[0] += total;
            counters[gridDim.x] = 0;
        }
    }
}
