// DyT, Dynamic Tanh (Zhu, Chen, He, LeCun and Liu, 2025), a replacement for LayerNorm without row statistics:
//   forward:  y = weight * tanh(alpha * x) + bias, alpha one learnable number (alpha[0], on the device);
//   backward: with t = tanh(alpha x) and t' = 1 - t^2,
//             dx = dout * weight * alpha * t',  dalpha += sum over all elements of dout * weight * x * t',
//             dweight += sum over rows of dout * t,  dbias += sum over rows of dout.
// Rows of C = columns floats. The forward is elementwise; the backward keeps a lane on the same columns
// for every row it handles, so that the column sums build up in registers (layernorm.cu's layout).

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float warp_sum(float value)
{
    for (int offset = WARP_SIZE / 2; offset > 0; offset /= 2) {
        value += __shfl_xor_sync(FULL_MASK, value, offset);
    }
    return value;
}

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

template <int WIDTH>
__device__ __forceinline__ void load_group(float* destination, const float* source, bool inside)
{
    if (!inside) {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = 0.0f;
        }
    } else if (WIDTH == 4) {
        float4 group = *reinterpret_cast<const float4*>(source);
        destination[0] = group.x;
        destination[1] = group.y;
        destination[2] = group.z;
        destination[3] = group.w;
    } else {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = source[w];
        }
    }
}

template <int WIDTH>
__device__ __forceinline__ void store_group(float* destination, const float* source)
{
    if (WIDTH == 4) {
        *reinterpret_cast<float4*>(destination) = make_float4(source[0], source[1], source[2], source[3]);
    } else {
        for (int w = 0; w < WIDTH; ++w) {
            destination[w] = source[w];
        }
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
    float dalpha = 0.0f;
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
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < warps; ++w) {
            total += alpha_sums[w];
        }
        alpha_partials[blockIdx.x] = total;
    }
}
