// Softmax over the last axis of float32 rows, y = softmax(scale * x), forward and backward.
// Rows of `columns` elements, `rows` of them, in row-major order. Two shapes of work:
//   rows up to 1024 long (attention scores, (B, H, T, T)): a warp per row, the row kept in registers,
//     so it is read from memory once;
//   longer rows (the logits' vocabulary rows, (B, T, V), V = 50257): a block per row and the online
//     softmax, which finds the maximum and the sum of exponentials in one pass.
// causal = 1: the rows are (..., T, T) with T = columns; row t keeps columns 0..t and writes 0 past them,
// and never reads the masked entries. A row that is all -inf has no softmax: it gives NaN, as 0 / 0.

#include "warp.cuh"
#include "float_groups.cuh"
#include "special_values.cuh"

// How many columns of a row take part: all of them, or 0..t for row t of a causal (T, T) matrix.
__device__ __forceinline__ int valid_columns(int row, int columns, int causal)
{
    return causal ? row % columns + 1 : columns;
}

// ---- Rows up to 1024: a warp per row, the row in registers ---------------------------------------------
// Lane `lane` holds the groups of WIDTH neighbouring columns that start at columns (lane + 32 k) WIDTH,
// k = 0 .. K - 1. WIDTH = 1: one float per load, the warp's 32 loads one 128-byte line. WIDTH = 4: one
// float4 per load, the warp's 32 loads four neighbouring lines, 512 bytes: a quarter of the load and store
// instructions and their address arithmetic for the same bytes, each moving a whole 16-byte piece. float4
// needs every group on a 16-byte boundary: columns a multiple of 4 and the arrays starting on 16 bytes (the
// op checks; otherwise WIDTH = 1). WIDTH and K are template parameters, compile-time constants: the loops
// unroll and the arrays below live in registers. No load's address depends on an earlier load's value, so
// the compiler issues all K before it waits for the first: K loads in flight per lane. Launch with
// columns <= 32 K WIDTH and blockDim.x a multiple of 32, at most WARP_ROW_THREADS (the op launches 8 warps,
// 8 rows, per block).
//
// Registers decide how many warps a multiprocessor holds (65536 registers): the more warps, the more
// loads in flight to cover memory's latency. __launch_bounds__(threads, blocks) asks the compiler to fit
// `blocks` blocks of `threads` threads on a multiprocessor. For the forward, 5 blocks of 256 threads
// leave 51 registers per thread (48 once rounded), enough for the 32 floats of a row of 1024 and the
// rest: 40 warps. Left free, CUDA 13's compiler takes 79: 3 blocks, 24 warps. The backward holds two rows,
// 64 floats per lane, and takes what it needs (78 registers, 3 blocks). (bench/softmax.py also compiles
// the file with -DFORWARD_WARP_ROW_BLOCKS=3 and 6, to compare: 6 leaves 40 registers, too few for the row,
// and the compiler spills some values to memory.)
#define WARP_ROW_THREADS 256
#ifndef FORWARD_WARP_ROW_BLOCKS
#define FORWARD_WARP_ROW_BLOCKS 5
#endif

// Causal rows: a group is loaded when its first column takes part. With WIDTH = 4 the group that holds the
// row's last valid column may bring up to 3 masked neighbours along, from the same 32-byte sector of memory
// that the valid ones come from anyway; a select puts -inf in their place, whatever they hold (even NaN).
template <int WIDTH, int K>
__global__ void __launch_bounds__(WARP_ROW_THREADS, FORWARD_WARP_ROW_BLOCKS)
softmax_forward_warp(float* y, const float* x, int rows, int columns, float scale, int causal)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const float* x_row = x + (long long)row * columns;
    float* y_row = y + (long long)row * columns;
    int valid = valid_columns(row, columns, causal);

    float z[K * WIDTH];
    float maximum = NEGATIVE_INFINITY;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
        load_group<WIDTH>(z + k * WIDTH, x_row + column, column < valid);
#pragma unroll
        for (int w = 0; w < WIDTH; ++w) {
            int i = k * WIDTH + w;
            z[i] = column + w < valid ? scale * z[i] : NEGATIVE_INFINITY;  // a choice: a NaN there is dropped
            maximum = fmaxf(maximum, z[i]);
        }
    }
    maximum = warp_max(maximum);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < K * WIDTH; ++i) {
        z[i] = expf(z[i] - maximum);  // <= 1: no overflow whatever x is
        sum += z[i];
    }
    float inverse_sum = 1.0f / warp_sum(sum);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
        if (column < columns) {
            float y_group[WIDTH];
#pragma unroll
            for (int w = 0; w < WIDTH; ++w) {
                y_group[w] = column + w < valid ? z[k * WIDTH + w] * inverse_sum : 0.0f;
            }
            store_group<WIDTH>(y_row + column, y_group);
        }
    }
}

// dx = scale * y * (dout - sum_j dout_j y_j), a warp per row, both rows in registers.
template <int WIDTH, int K>
__global__ void __launch_bounds__(WARP_ROW_THREADS)
softmax_backward_warp(float* dx, const float* dout, const float* y, int rows, int columns, float scale)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;
    }
    long long start = (long long)row * columns;
    float y_values[K * WIDTH], dout_values[K * WIDTH];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
        load_group<WIDTH>(y_values + k * WIDTH, y + start + column, column < columns);
        load_group<WIDTH>(dout_values + k * WIDTH, dout + start + column, column < columns);
#pragma unroll
        for (int w = 0; w < WIDTH; ++w) {
            dot += dout_values[k * WIDTH + w] * y_values[k * WIDTH + w];  // a group past the row's end holds 0s
        }
    }
    dot = warp_sum(dot);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = (lane + k * WARP_SIZE) * WIDTH;
        if (column < columns) {
            float dx_group[WIDTH];
#pragma unroll
            for (int w = 0; w < WIDTH; ++w) {
                dx_group[w] = scale * y_values[k * WIDTH + w] * (dout_values[k * WIDTH + w] - dot);
            }
            store_group<WIDTH>(dx + start + column, dx_group);
        }
    }
}

// The online softmax (Milakov and Gimelshein, 2018): a running maximum m and a sum s of exp(z - m).
// When a larger value arrives, the sum so far is rescaled to the new maximum: s exp(m_old - m_new).
struct MaxSum {
    float maximum;
    float sum;
};

__device__ __forceinline__ MaxSum online_add(MaxSum state, float z)
{
    if (z > state.maximum) {
        state.sum = state.sum * expf(state.maximum - z) + 1.0f;  // exp(-inf) = 0 for the first value
        state.maximum = z;
    } else if (z > NEGATIVE_INFINITY) {
        state.sum += expf(z - state.maximum);
    }  // z = -inf adds exp(-inf) = 0 (computing it would give exp(-inf - (-inf)) = NaN)
    return state;
}

__device__ __forceinline__ MaxSum online_combine(MaxSum a, MaxSum b)
{
    float maximum = fmaxf(a.maximum, b.maximum);
    if (maximum == NEGATIVE_INFINITY) {
        return a;  // both empty so far
    }
    MaxSum combined = {maximum, a.sum * expf(a.maximum - maximum) + b.sum * expf(b.maximum - maximum)};
    return combined;
}

__device__ __forceinline__ MaxSum warp_online_combine(MaxSum state)
{
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        MaxSum other = {__shfl_xor_sync(FULL_MASK, state.maximum, offset),
                        __shfl_xor_sync(FULL_MASK, state.sum, offset)};
        state = online_combine(state, other);
    }
    return state;
}

// Combine one value per thread over the block (blockDim.x a multiple of 32, at most 1024): warps first,
// then warp 0 combines the warps' results in a fixed order. Every thread gets the result.
__device__ MaxSum block_online_combine(MaxSum state)
{
    __shared__ float maxima[WARP_SIZE], sums[WARP_SIZE];
    __shared__ MaxSum result;
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    state = warp_online_combine(state);
    if (lane == 0) {
        maxima[warp] = state.maximum;
        sums[warp] = state.sum;
    }
    __syncthreads();
    if (warp == 0) {
        MaxSum partial = {NEGATIVE_INFINITY, 0.0f};
        if (lane < warps) {
            partial.maximum = maxima[lane];
            partial.sum = sums[lane];
        }
        partial = warp_online_combine(partial);
        if (lane == 0) {
            result = partial;
        }
    }
    __syncthreads();
    return result;
}

// A block per row, for long rows: block b handles rows b, b + gridDim.x, ... (a grid of one block per row,
// or fewer blocks that each take several rows: then fewer rows are in flight at once, and the second read
// of a row is more likely to find it still in the L2 cache). Pass 1 reads the row once with the online
// update; pass 2 reads it again and writes y. Each thread takes eight elements per step, blockDim.x apart:
// eight loads in flight before the first is needed (and in pass 1 one rescaling of its sum per eight).
#define UNROLL 8

extern "C" __global__ void softmax_forward_block(float* y, const float* x, int rows, int columns, float scale,
                                                 int causal)
{
    int stride = blockDim.x;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x_row = x + (long long)row * columns;
        float* y_row = y + (long long)row * columns;
        int valid = valid_columns(row, columns, causal);

        MaxSum state = {NEGATIVE_INFINITY, 0.0f};
        int column = threadIdx.x;
        for (; column + (UNROLL - 1) * stride < valid; column += UNROLL * stride) {
            float z[UNROLL];
            float chunk_maximum = NEGATIVE_INFINITY;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                z[u] = scale * x_row[column + u * stride];
                chunk_maximum = fmaxf(chunk_maximum, z[u]);
            }
            MaxSum chunk = {chunk_maximum, 0.0f};
            if (chunk_maximum > NEGATIVE_INFINITY) {  // all eight -inf: the chunk adds nothing
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    chunk.sum += expf(z[u] - chunk_maximum);
                }
            }
            state = online_combine(state, chunk);
        }
        for (; column < valid; column += stride) {
            state = online_add(state, scale * x_row[column]);
        }
        state = block_online_combine(state);

        float inverse_sum = 1.0f / state.sum;
        for (column = threadIdx.x; column + (UNROLL - 1) * stride < columns; column += UNROLL * stride) {
            float z[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {  // all loads first: eight in flight
                int c = column + u * stride;
                z[u] = c < valid ? scale * x_row[c] : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                int c = column + u * stride;
                y_row[c] = c < valid ? expf(z[u] - state.maximum) * inverse_sum : 0.0f;
            }
        }
        for (; column < columns; column += stride) {
            y_row[column] = column < valid ? expf(scale * x_row[column] - state.maximum) * inverse_sum : 0.0f;
        }
    }
}

extern "C" __global__ void softmax_backward_block(float* dx, const float* dout, const float* y, int rows,
                                                  int columns, float scale)
{
    int stride = blockDim.x;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        long long start = (long long)row * columns;
        float dot = 0.0f;
        int column = threadIdx.x;
        for (; column + (UNROLL - 1) * stride < columns; column += UNROLL * stride) {
            float d[UNROLL], v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                d[u] = dout[start + column + u * stride];
                v[u] = y[start + column + u * stride];
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                dot += d[u] * v[u];
            }
        }
        for (; column < columns; column += stride) {
            dot += dout[start + column] * y[start + column];
        }
        dot = block_sum(dot);
        for (column = threadIdx.x; column + (UNROLL - 1) * stride < columns; column += UNROLL * stride) {
            float d[UNROLL], v[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                d[u] = dout[start + column + u * stride];
                v[u] = y[start + column + u * stride];
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                dx[start + column + u * stride] = scale * v[u] * (d[u] - dot);
            }
        }
        for (; column < columns; column += stride) {
            dx[start + column] = scale * y[start + column] * (dout[start + column] - dot);
        }
    }
}

// ---- Long rows, the row kept in shared memory: read once ------------------------------------------------
// A row of 50257 floats is 201 KB: too long for a block's registers, short enough for its shared memory
// (227 KB per block on an H100, after the opt-in). The forward reads x once into shared memory, finding the
// maximum and the sum on the way, then writes y from there; the backward keeps y there while it finds
// sum_j dout_j y_j, then reads dout a second time, from the L2 cache if it is still there.
//
// The row's floats move as float4s, 16 bytes per load. Rows of 50257 floats start 4 bytes further along
// each time, so only one row in four starts on a 16-byte boundary: each thread takes its row in three
// parts, the `head` (0 to 3 floats up to the first boundary, one by one), the float4s, and the `tail`
// (0 to 3 floats after the last whole float4). All arrays of one launch must start on 16 bytes (the op
// checks; CuPy's allocations start on 256): then a row has the same head in all of them.
// In shared memory, column c sits at cache[c + shift], shift = (4 - floats to the boundary) % 4, so that the
// row's float4s land on float4s of shared memory too (a float4 load or store needs a 16-byte aligned address).
// The cache holds columns + 3 floats: launch with shared_mem = 4 (columns + 3) bytes.
// Only one such block fits on a multiprocessor, so its own loads must keep the memory busy: each thread
// issues four float4 loads before using the first, 1024 x 4 x 16 B = 64 KB in flight per block.
// __launch_bounds__(1024) tells the compiler that blocks have 1024 threads: it must then fit each thread
// in 64 registers (65536 per multiprocessor); with more, a block of 1024 threads could not launch at all.
// The backward loads y and dout: BACKWARD_VECTORS_PER_STEP float4s of each in flight per thread. (bench/softmax.py
// also compiles the file with -DVECTORS_PER_STEP=8 and -DBACKWARD_VECTORS_PER_STEP=4, to compare.)
#ifndef VECTORS_PER_STEP
#define VECTORS_PER_STEP 4
#endif
#ifndef BACKWARD_VECTORS_PER_STEP
#define BACKWARD_VECTORS_PER_STEP 8
#endif
#define LONG_ROW_THREADS 1024

// The online state of a few values at once: their maximum first, then one sum relative to it.
__device__ __forceinline__ MaxSum max_sum_of(const float* z, int n)
{
    MaxSum state = {NEGATIVE_INFINITY, 0.0f};
    for (int i = 0; i < n; ++i) {
        state.maximum = fmaxf(state.maximum, z[i]);
    }
    if (state.maximum > NEGATIVE_INFINITY) {  // all -inf: nothing to add
        for (int i = 0; i < n; ++i) {
            state.sum += expf(z[i] - state.maximum);
        }
    }
    return state;
}

// exp(z - maximum) / sum for four values at once.
__device__ __forceinline__ float4 probabilities(float4 z, float maximum, float inverse_sum)
{
    return make_float4(expf(z.x - maximum) * inverse_sum, expf(z.y - maximum) * inverse_sum,
                       expf(z.z - maximum) * inverse_sum, expf(z.w - maximum) * inverse_sum);
}

// scale * y * (dout - dot) for four values at once.
__device__ __forceinline__ float4 gradients(float4 y, float4 dout, float dot, float scale)
{
    return make_float4(scale * y.x * (dout.x - dot), scale * y.y * (dout.y - dot), scale * y.z * (dout.z - dot),
                       scale * y.w * (dout.w - dot));
}

extern "C" __global__ void __launch_bounds__(LONG_ROW_THREADS)
softmax_forward_shared(float* y, const float* x, int rows, int columns, float scale, int causal)
{
    extern __shared__ __align__(16) float cache[];
    int threads = blockDim.x;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const float* x_row = x + (long long)row * columns;
        float* y_row = y + (long long)row * columns;
        int valid = valid_columns(row, columns, causal);
        int boundary = floats_to_boundary(x_row);
        int shift = (4 - boundary) % 4;
        int head = min(boundary, valid);
        int vectors = (valid - head) / 4;  // whole float4s among the columns that take part
        const float4* x_vectors = reinterpret_cast<const float4*>(x_row + head);
        float4* cache_vectors = reinterpret_cast<float4*>(cache + head + shift);

        // Pass 1: x from global memory into shared memory, once, with the online maximum and sum.
        MaxSum state = {NEGATIVE_INFINITY, 0.0f};
        int v = threadIdx.x;
        for (; v + (VECTORS_PER_STEP - 1) * threads < vectors; v += VECTORS_PER_STEP * threads) {
            float4 loaded[VECTORS_PER_STEP];
#pragma unroll
            for (int u = 0; u < VECTORS_PER_STEP; ++u) {  // all loads first: VECTORS_PER_STEP in flight
                loaded[u] = __ldcs(x_vectors + v + u * threads);  // streaming: x is not read again
            }
            float z[4 * VECTORS_PER_STEP];
#pragma unroll
            for (int u = 0; u < VECTORS_PER_STEP; ++u) {
                float4 scaled = make_float4(scale * loaded[u].x, scale * loaded[u].y, scale * loaded[u].z,
                                            scale * loaded[u].w);
                cache_vectors[v + u * threads] = scaled;
                z[4 * u] = scaled.x;
                z[4 * u + 1] = scaled.y;
                z[4 * u + 2] = scaled.z;
                z[4 * u + 3] = scaled.w;
            }
            state = online_combine(state, max_sum_of(z, 4 * VECTORS_PER_STEP));
        }
        for (; v < vectors; v += threads) {
            float4 loaded = __ldcs(x_vectors + v);
            float z[4] = {scale * loaded.x, scale * loaded.y, scale * loaded.z, scale * loaded.w};
            cache_vectors[v] = make_float4(z[0], z[1], z[2], z[3]);
            state = online_combine(state, max_sum_of(z, 4));
        }
        // The head and the tail, at most 3 + 3 floats: one each for the first threads.
        int tail = head + 4 * vectors;
        int loose = threadIdx.x < head ? threadIdx.x : tail + threadIdx.x - head;
        if (loose < valid && threadIdx.x < head + 3) {
            float z = scale * x_row[loose];
            cache[loose + shift] = z;
            state = online_add(state, z);
        }
        state = block_online_combine(state);  // its __syncthreads also make the whole cache visible

        // Pass 2: y from shared memory; columns past `valid` (causal rows) get 0.
        float maximum = state.maximum, inverse_sum = 1.0f / state.sum;
        float4* y_vectors = reinterpret_cast<float4*>(y_row + head);
        for (v = threadIdx.x; v < vectors; v += threads) {  // shared memory answers fast: no unrolling needed
            __stcs(y_vectors + v, probabilities(cache_vectors[v], maximum, inverse_sum));  // streaming store
        }
        if (loose < valid && threadIdx.x < head + 3) {
            y_row[loose] = expf(cache[loose + shift] - maximum) * inverse_sum;
        }
        for (int column = valid + threadIdx.x; column < columns; column += threads) {
            y_row[column] = 0.0f;
        }
        __syncthreads();  // the next row overwrites the cache only when every thread is done reading it
    }
}

// dx = scale * y * (dout - sum_j dout_j y_j): y goes into shared memory while the dot product is taken;
// then dx needs dout a second time. That second read comes from the L2 cache (50 MB on an H100) when the
// row is still there: with one block per multiprocessor, 132 rows of dout (26 MB) are in use at once.
// The loads say which data will be needed again: y and the second read of dout are streaming (__ldcs,
// evicted first), the first read of dout an ordinary load, kept.
extern "C" __global__ void __launch_bounds__(LONG_ROW_THREADS)
softmax_backward_shared(float* dx, const float* dout, const float* y, int rows, int columns, float scale)
{
    extern __shared__ __align__(16) float cache[];
    int threads = blockDim.x;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        long long start = (long long)row * columns;
        int boundary = floats_to_boundary(y + start);
        int shift = (4 - boundary) % 4;
        int head = min(boundary, columns);
        int vectors = (columns - head) / 4;
        const float4* y_vectors = reinterpret_cast<const float4*>(y + start + head);
        const float4* dout_vectors = reinterpret_cast<const float4*>(dout + start + head);
        float4* dx_vectors = reinterpret_cast<float4*>(dx + start + head);
        float4* cache_vectors = reinterpret_cast<float4*>(cache + head + shift);

        float dot = 0.0f;
        int v = threadIdx.x;
        for (; v + (BACKWARD_VECTORS_PER_STEP - 1) * threads < vectors; v += BACKWARD_VECTORS_PER_STEP * threads) {
            float4 y_loaded[BACKWARD_VECTORS_PER_STEP], dout_loaded[BACKWARD_VECTORS_PER_STEP];
#pragma unroll
            for (int u = 0; u < BACKWARD_VECTORS_PER_STEP; ++u) {
                y_loaded[u] = __ldcs(y_vectors + v + u * threads);
                dout_loaded[u] = dout_vectors[v + u * threads];
            }
#pragma unroll
            for (int u = 0; u < BACKWARD_VECTORS_PER_STEP; ++u) {
                cache_vectors[v + u * threads] = y_loaded[u];
                dot += dout_loaded[u].x * y_loaded[u].x + dout_loaded[u].y * y_loaded[u].y
                       + dout_loaded[u].z * y_loaded[u].z + dout_loaded[u].w * y_loaded[u].w;
            }
        }
        for (; v < vectors; v += threads) {
            float4 y_loaded = __ldcs(y_vectors + v), dout_loaded = dout_vectors[v];
            cache_vectors[v] = y_loaded;
            dot += dout_loaded.x * y_loaded.x + dout_loaded.y * y_loaded.y + dout_loaded.z * y_loaded.z
                   + dout_loaded.w * y_loaded.w;
        }
        int tail = head + 4 * vectors;
        int loose = threadIdx.x < head ? threadIdx.x : tail + threadIdx.x - head;
        if (loose < columns && threadIdx.x < head + 3) {
            float y_value = y[start + loose];
            cache[loose + shift] = y_value;
            dot += dout[start + loose] * y_value;
        }
        dot = block_sum(dot);  // its __syncthreads also make the whole cache visible

        // dout again, from the L2 cache or from memory: as many loads in flight per thread as in the first pass.
        for (v = threadIdx.x; v + (BACKWARD_VECTORS_PER_STEP - 1) * threads < vectors; v += BACKWARD_VECTORS_PER_STEP * threads) {
            float4 dout_again[BACKWARD_VECTORS_PER_STEP];
#pragma unroll
            for (int u = 0; u < BACKWARD_VECTORS_PER_STEP; ++u) {
                dout_again[u] = __ldcs(dout_vectors + v + u * threads);  // its last use: evict first
            }
#pragma unroll
            for (int u = 0; u < BACKWARD_VECTORS_PER_STEP; ++u) {
                int w = v + u * threads;
                __stcs(dx_vectors + w, gradients(cache_vectors[w], dout_again[u], dot, scale));
            }
        }
        for (; v < vectors; v += threads) {
            __stcs(dx_vectors + v, gradients(cache_vectors[v], __ldcs(dout_vectors + v), dot, scale));
        }
        if (loose < columns && threadIdx.x < head + 3) {
            dx[start + loose] = scale * cache[loose + shift] * (dout[start + loose] - dot);
        }
        __syncthreads();
    }
}
