#define ROW_THREADS 128

// The sum of one value per thread over the block, in a fixed order; every thread gets the total.
__device__ float block_total(float value, float* shared)
{
    shared[threadIdx.x] = value;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {
        if (threadIdx.x < half) {
            shared[threadIdx.x] += shared[threadIdx.x + half];
        }
        __syncthreads();
    }
    float total = shared[0];
    __syncthreads();   // everyone has read shared[0] before the next sum overwrites it
    return total;
}

// LayerNorm's statistics, one block per row: the mean, then the variance of x - mean (two passes, no
// cancellation), and rstd = 1 / sqrt(variance + eps).
extern "C" __global__ void row_mean_rstd(float* mean, float* rstd, const float* x, int columns, float eps)
{
    __shared__ float shared[ROW_THREADS];
    const float* row = x + (long)blockIdx.x * columns;
    float sum = 0.0f;
    for (int c = threadIdx.x; c < columns; c += blockDim.x) {
        sum += row[c];
    }
    float row_mean = block_total(sum, shared) / columns;
    float squares = 0.0f;
    for (int column = threadIdx.x; column < columns; column += blockDim.x) {
        float centred = row[column] - row_mean;
        squares += centred * centred;
    }
    float variance = block_total(squares, shared) / columns;
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = row_mean;
        rstd[blockIdx.x] = rsqrtf(variance + eps);
    }
}
