// LayerNorm over the last axis of float32 rows (GPT-2's ln_1, ln_2, ln_f), forward and backward.
//   forward:  y = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(variance + eps), per row of C;
//             mean and rstd are saved per row for the backward.
//   backward: dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = weight * dout, xhat = (x - mean) * rstd;
//             dweight += sum over rows of dout * xhat, dbias += sum over rows of dout.
// A warp per row, the row kept in registers, so that x (and dout) are read from memory once.
// Lane `lane` holds the groups of WIDTH neighbouring columns that start at (lane + 32 k) WIDTH, k < K:
// WIDTH = 4 moves them with one 16-byte load (C a multiple of 4, arrays 16-byte aligned), WIDTH = 1 with
// one 4-byte load each. The template parameters are compile-time constants, so the loops unroll and the
// arrays below live in registers. Launch with C <= 32 K WIDTH.
// floatX is how x, y, dout and dx are stored (storage.cuh): float, or bf16 for a model trained in bf16
// (WIDTH = 4 then moves 8 bytes). Everything else is float32: weight, bias, mean, rstd, the parameter
// gradients, and every sum, so a bf16 row is read into floats and only y and dx are rounded, once.

#include "warp.cuh"
#include "float_groups.cuh"
#include "row_norm_partials.cuh"
#include "storage.cuh"

template <int WIDTH, int K, typename floatX = float>
__global__ void layernorm_forward(floatX* y, float* mean, float* rstd, const floatX* x, const float* weight,
                                  const float* bias, int rows, int columns, float eps, int has_bias)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const floatX* x_row = x + (long long)row * columns;
    floatX* y_row = y + (long long)row * columns;

    float values[K * WIDTH];
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
        load_as_float<WIDTH>(values + k * WIDTH, x_row + column, column < columns);
#pragma unroll
        for (int w = 0; w < WIDTH; ++w) {
            sum += values[k * WIDTH + w];
        }
    }
    float row_mean = warp_sum(sum) / columns;

    // The variance from the deviations, a second pass over registers: E[x^2] - mean^2 would cancel when
    // the mean is large against the spread.
    float squares = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
#pragma unroll
        for (int w = 0; w < WIDTH; ++w) {
            float deviation = column < columns ? values[k * WIDTH + w] - row_mean : 0.0f;
            squares += deviation * deviation;
        }
    }
    float row_rstd = rsqrtf(warp_sum(squares) / columns + eps);

#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
        if (column < columns) {
            float scale[WIDTH], shift[WIDTH], result[WIDTH];
            load_group<WIDTH>(scale, weight + column, true);
            load_group<WIDTH>(shift, bias + column, has_bias != 0);
#pragma unroll
            for (int w = 0; w < WIDTH; ++w) {
                result[w] = (values[k * WIDTH + w] - row_mean) * row_rstd * scale[w] + shift[w];
            }
            store_from_float<WIDTH>(y_row + column, result);
        }
    }
    if (lane == 0) {
        mean[row] = row_mean;
        rstd[row] = row_rstd;
    }
}

// Block b handles rows [b rows_per_block, (b + 1) rows_per_block), its warps taking turns. Each lane adds its
// columns' dweight and dbias terms in registers; at the end the block's warps add theirs into shared memory
// one warp after the other (a fixed order: the same sums on every run), and the block writes one row of
// partial sums. column_sums_accumulate then adds the blocks' rows into dweight and dbias.
// Dynamic shared memory: 2 * columns floats.
template <int WIDTH, int K>
__global__ void layernorm_backward(float* dx, float* weight_partials, float* bias_partials, const float* dout,
                                   const float* x, const float* weight, const float* mean, const float* rstd,
                                   int rows, int columns, int rows_per_block)
{
    extern __shared__ float shared[];
    float* weight_sums = shared;
    float* bias_sums = shared + columns;
    int warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;

    float scale[K * WIDTH], dweight[K * WIDTH], dbias[K * WIDTH];
    begin_column_partials<K, WIDTH>(scale, dweight, dbias, weight, columns);

    int first = blockIdx.x * rows_per_block;
    int last = min(first + rows_per_block, rows);
    for (int row = first + warp; row < last; row += warps) {
        long long start = (long long)row * columns;
        float row_mean = mean[row], row_rstd = rstd[row];
        float x_hat[K * WIDTH], g[K * WIDTH];
        float g_sum = 0.0f, g_x_hat_sum = 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int column = (lane + k * WARP_SIZE) * WIDTH;
            float d[WIDTH];
            load_group<WIDTH>(x_hat + k * WIDTH, x + start + column, column < columns);
            load_group<WIDTH>(d, dout + start + column, column < columns);
#pragma unroll
            for (int w = 0; w < WIDTH; ++w) {
                int i = k * WIDTH + w;
                x_hat[i] = (x_hat[i] - row_mean) * row_rstd;  // recomputed, not stored by the forward
                g[i] = scale[i] * d[w];                        // 0 past the row's end, where d is 0
                g_sum += g[i];
                g_x_hat_sum += g[i] * x_hat[i];
                dweight[i] += d[w] * x_hat[i];
                dbias[i] += d[w];
            }
        }
        float g_mean = warp_sum(g_sum) / columns;
        float g_x_hat_mean = warp_sum(g_x_hat_sum) / columns;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int column = (lane + k * WARP_SIZE) * WIDTH;
            if (column < columns) {
                float result[WIDTH];
#pragma unroll
                for (int w = 0; w < WIDTH; ++w) {
                    int i = k * WIDTH + w;
                    result[w] = row_rstd * (g[i] - g_mean - x_hat[i] * g_x_hat_mean);
                }
                store_group<WIDTH>(dx + start + column, result);
            }
        }
    }

    block_column_partials<K, WIDTH>(dweight, dbias, weight_sums, bias_sums, weight_partials, bias_partials, columns);
}

// first_sums[c] += sum over p of partials[0][p][c], and, launched with gridDim.y = 2, second_sums[c] += the
// same over partials[1]: the finishing step of a deterministic column sum, for partials of shape
// (gridDim.y, parts, columns). Blocks of (32, S) threads, S <= 32: threadIdx.x picks a column, the S rows
// of threads each add every S-th part, then row 0 adds the S results in order.
// The work is a few hundred kilobytes that wait in the L2, so what the kernel costs is mostly latency: a
// thread loads its parts 16 at a time (zeros past the last part) before adding them, so that those loads are
// in flight together instead of one after another, and the sum being added to is read first, so that its
// read overlaps them. (A plain loop, even unrolled, checks `part < parts` before each load, and the loads
// then wait for each other: `cuobjdump -sass` shows it.)
extern "C" __global__ void column_sums_accumulate(float* first_sums, float* second_sums, const float* partials,
                                                  int parts, int columns)
{
    __shared__ float stripes[WARP_SIZE][WARP_SIZE + 1];  // +1: no two threads of a warp share a bank
    const float* own = partials + (long long)blockIdx.y * parts * columns;
    float* sums = blockIdx.y == 0 ? first_sums : second_sums;
    int column = blockIdx.x * WARP_SIZE + threadIdx.x;
    bool finishing = threadIdx.y == 0 && column < columns;
    float previous = finishing ? sums[column] : 0.0f;
    float sum = 0.0f;
    if (column < columns) {
        constexpr int PARTS_AT_ONCE = 16;
        for (int first = threadIdx.y; first < parts; first += PARTS_AT_ONCE * blockDim.y) {
            float values[PARTS_AT_ONCE];
#pragma unroll
            for (int i = 0; i < PARTS_AT_ONCE; ++i) {
                int part = first + i * blockDim.y;
                values[i] = part < parts ? own[(long long)part * columns + column] : 0.0f;
            }
#pragma unroll
            for (int i = 0; i < PARTS_AT_ONCE; ++i) {
                sum += values[i];  // in the order of the parts; adding a zero changes nothing
            }
        }
    }
    stripes[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (finishing) {
        float total = 0.0f;
        for (int stripe = 0; stripe < blockDim.y; ++stripe) {
            total += stripes[stripe][threadIdx.x];
        }
        sums[column] = previous + total;  // added, not set: a parameter's gradient accumulates
    }
}

// The backward with fewer registers, so that more warps share a multiprocessor: the running column sums live
// in shared memory, a private slice of 2 * columns floats per warp (a lane adds only into its own columns of
// its own warp's slice: no other thread touches them, so no synchronisation and no atomics), and weight is
// read again where it is needed (3 KB at C = 768: it stays in the L1 cache). What remains in registers per
// lane is the row: x_hat and dout, 2 K WIDTH floats, 48 at C = 768, 102 registers in all against ~170 for
// layernorm_backward above: 65536 / (102 * 32) = 20 warps fit where 12 did.
// Block b handles rows [b rows_per_block, (b + 1) rows_per_block), its warps taking turns; at the end the
// block adds the warps' slices in order (warp 0, 1, ...) and writes one row of partial dweight and one of
// partial dbias; column_sums_accumulate then adds the blocks' rows of both into dweight and dbias in one
// launch. rows_per_block is a fixed number, not a function of the GPU, so that the order of every addition,
// and hence every bit of the result, is the same on any device. Dynamic shared memory: 2 * warps * columns
// floats.
// __launch_bounds__(256, 2): at most 256 threads per block, and registers for 2 blocks per multiprocessor
// (128 per thread). Without it, ptxas settles on 80 registers for <4, 6> and, short of room, issues the last
// two of a lane's six pairs of row loads only after the arithmetic on the first four has begun (two batches of
// LDG.E.128 in `cuobjdump -sass`); with it, it takes 102 and all twelve leave together. Rows longer than 32
// floats per lane need more than 128 registers: one block per multiprocessor, as they had without the bound.
template <int WIDTH, int K, typename floatX = float>
__global__ void __launch_bounds__(256, K * WIDTH <= 32 ? 2 : 1)
layernorm_backward_shared(floatX* dx, float* weight_partials, float* bias_partials, const floatX* dout,
                          const floatX* x, const float* weight, const float* mean, const float* rstd, int rows,
                          int columns, int rows_per_block)
{
    extern __shared__ float shared[];
    int warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    float* weight_sums = shared + 2 * warp * columns;  // this warp's slice
    float* bias_sums = weight_sums + columns;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
        for (int w = 0; w < WIDTH && column + w < columns; ++w) {
            weight_sums[column + w] = 0.0f;
            bias_sums[column + w] = 0.0f;
        }
    }

    int first = blockIdx.x * rows_per_block;
    int last = min(first + rows_per_block, rows);
    for (int row = first + warp; row < last; row += warps) {
        long long start = (long long)row * columns;
        float row_mean = mean[row], row_rstd = rstd[row];
        float x_hat[K * WIDTH], d[K * WIDTH];
        // First pass: only loads and arithmetic, so that all 2 K loads of the row are in flight at once.
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int column = (lane + k * WARP_SIZE) * WIDTH;
            load_as_float<WIDTH>(x_hat + k * WIDTH, x + start + column, column < columns);
            load_as_float<WIDTH>(d + k * WIDTH, dout + start + column, column < columns);
        }
        float g_sum = 0.0f, g_x_hat_sum = 0.0f;
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int column = (lane + k * WARP_SIZE) * WIDTH;
            float scale[WIDTH];
            load_group<WIDTH>(scale, weight + column, column < columns);
#pragma unroll
            for (int w = 0; w < WIDTH; ++w) {
                int i = k * WIDTH + w;
                x_hat[i] = (x_hat[i] - row_mean) * row_rstd;  // recomputed, not stored by the forward
                float g = scale[w] * d[i];                     // 0 past the row's end, where d is 0
                g_sum += g;
                g_x_hat_sum += g * x_hat[i];
            }
        }
        float g_mean = warp_sum(g_sum) / columns;
        float g_x_hat_mean = warp_sum(g_x_hat_sum) / columns;
        // Second pass: dx, and this row's terms added into the warp's running column sums.
#pragma unroll
        for (int k = 0; k < K; ++k) {
            int column = (lane + k * WARP_SIZE) * WIDTH;
            if (column < columns) {
                float scale[WIDTH], result[WIDTH], weight_group[WIDTH], bias_group[WIDTH];
                load_group<WIDTH>(scale, weight + column, true);
                // float4 reads and writes of shared memory for WIDTH = 4: a lane's four floats in one access,
                // and the warp's 512 bytes without two lanes on one bank in the same pass.
                load_group<WIDTH>(weight_group, weight_sums + column, true);
                load_group<WIDTH>(bias_group, bias_sums + column, true);
#pragma unroll
                for (int w = 0; w < WIDTH; ++w) {
                    int i = k * WIDTH + w;
                    result[w] = row_rstd * (scale[w] * d[i] - g_mean - x_hat[i] * g_x_hat_mean);
                    weight_group[w] += d[i] * x_hat[i];
                    bias_group[w] += d[i];
                }
                store_from_float<WIDTH>(dx + start + column, result);
                store_group<WIDTH>(weight_sums + column, weight_group);
                store_group<WIDTH>(bias_sums + column, bias_group);
            }
        }
    }

    __syncthreads();  // every warp's slice complete before the block adds them
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        float weight_total = 0.0f, bias_total = 0.0f;
        for (int w = 0; w < warps; ++w) {
            weight_total += shared[2 * w * columns + column];
            bias_total += shared[(2 * w + 1) * columns + column];
        }
        weight_partials[(long long)blockIdx.x * columns + column] = weight_total;
        bias_partials[(long long)blockIdx.x * columns + column] = bias_total;
    }
}
