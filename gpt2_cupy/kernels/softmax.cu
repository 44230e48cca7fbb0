// Softmax over the last axis of float32 rows, y = softmax(scale * x), forward and backward.
// Rows of `columns` elements, `rows` of them, in row-major order. Two shapes of work:
//   rows up to 1024 long (attention scores, (B, H, T, T)): a warp per row, the row kept in registers,
//     so it is read from memory once;
//   longer rows (the logits' vocabulary rows, (B, T, V), V = 50257): a block per row and the online
//     softmax, which finds the maximum and the sum of exponentials in one pass.
// causal = 1: the rows are (..., T, T) with T = columns; row t keeps columns 0..t and writes 0 past them,
// and never reads the masked entries. A row that is all -inf has no softmax: it gives NaN, as 0 / 0.

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

// -inf as a bit pattern: NVRTC compiles without <math.h>, so there is no INFINITY macro.
__device__ __forceinline__ float negative_infinity()
{
    return __uint_as_float(0xff800000u);
}

__device__ __forceinline__ float warp_max(float value)
{
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        value = fmaxf(value, __shfl_xor_sync(FULL_MASK, value, offset));
    }
    return value;  // every lane holds the maximum: xor shuffles are a butterfly
}

__device__ __forceinline__ float warp_sum(float value)
{
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        value += __shfl_xor_sync(FULL_MASK, value, offset);
    }
    return value;
}

// How many columns of a row take part: all of them, or 0..t for row t of a causal (T, T) matrix.
__device__ __forceinline__ int valid_columns(int row, int columns, int causal)
{
    return causal ? row % columns + 1 : columns;
}

// A warp per row; lane `lane` holds elements lane, lane + 32, ..., lane + 32 (K - 1): K loads in flight per
// lane, all issued before the first is needed. Launch with columns <= 32 K, blockDim.x a multiple of 32.
template <int K>
__global__ void softmax_forward_warp(float* y, const float* x, int rows, int columns, float scale, int causal)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    }
    const float* x_row = x + (long long)row * columns;
    float* y_row = y + (long long)row * columns;
    int valid = valid_columns(row, columns, causal);

    float z[K];
    float maximum = negative_infinity();
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = lane + k * WARP_SIZE;
        z[k] = column < valid ? scale * x_row[column] : negative_infinity();
        maximum = fmaxf(maximum, z[k]);
    }
    maximum = warp_max(maximum);
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        z[k] = expf(z[k] - maximum);  // <= 1: no overflow whatever x is
        sum += z[k];
    }
    float inverse_sum = 1.0f / warp_sum(sum);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = lane + k * WARP_SIZE;
        if (column < columns) {
            y_row[column] = column < valid ? z[k] * inverse_sum : 0.0f;
        }
    }
}

// dx = scale * y * (dout - sum_j dout_j y_j), a warp per row, both rows in registers.
template <int K>
__global__ void softmax_backward_warp(float* dx, const float* dout, const float* y, int rows, int columns,
                                      float scale)
{
    int row = (blockIdx.x * blockDim.x + threadIdx.x) / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) {
        return;
    }
    long long start = (long long)row * columns;
    float y_values[K], dout_values[K];
    float dot = 0.0f;
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = lane + k * WARP_SIZE;
        y_values[k] = column < columns ? y[start + column] : 0.0f;
        dout_values[k] = column < columns ? dout[start + column] : 0.0f;
        dot += dout_values[k] * y_values[k];
    }
    dot = warp_sum(dot);
#pragma unroll
    for (int k = 0; k < K; ++k) {
        int column = lane + k * WARP_SIZE;
        if (column < columns) {
            dx[start + column] = scale * y_values[k] * (dout_values[k] - dot);
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
    } else if (z > negative_infinity()) {
        state.sum += expf(z - state.maximum);
    }  // z = -inf adds exp(-inf) = 0 (computing it would give exp(-inf - (-inf)) = NaN)
    return state;
}

__device__ __forceinline__ MaxSum online_combine(MaxSum a, MaxSum b)
{
    float maximum = fmaxf(a.maximum, b.maximum);
    if (maximum == negative_infinity()) {
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
        MaxSum partial = {negative_infinity(), 0.0f};
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

__device__ float block_sum(float value)
{
    __shared__ float partials[WARP_SIZE];
    __shared__ float result;
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    value = warp_sum(value);
    if (lane == 0) {
        partials[warp] = value;
    }
    __syncthreads();
    if (warp == 0) {
        float partial = lane < warps ? partials[lane] : 0.0f;
        partial = warp_sum(partial);
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

        MaxSum state = {negative_infinity(), 0.0f};
        int column = threadIdx.x;
        for (; column + (UNROLL - 1) * stride < valid; column += UNROLL * stride) {
            float z[UNROLL];
            float chunk_maximum = negative_infinity();
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                z[u] = scale * x_row[column + u * stride];
                chunk_maximum = fmaxf(chunk_maximum, z[u]);
            }
            MaxSum chunk = {chunk_maximum, 0.0f};
            if (chunk_maximum > negative_infinity()) {  // all eight -inf: the chunk adds nothing
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
