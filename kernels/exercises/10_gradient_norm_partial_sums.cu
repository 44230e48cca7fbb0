#define PARTIAL_SUM_THREADS 128

// The first pass of the gradient norm: block b sums the squares of the elements i with
// (i / blockDim.x) % gridDim.x == b (a grid-stride loop) into partial_sums[b]. Every thread issues four
// loads before it adds anything, so that four of them are in flight at once.
extern "C" __global__ void gradient_norm_partial_sums(float* partial_sums, const float* grads, int n)
{
    __shared__ float partial[PARTIAL_SUM_THREADS];
    int stride = gridDim.x * blockDim.x;
    float sum = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += 4 * stride) {
        float g[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            int j = i + k * stride;
            g[k] = j < n ? grads[j] : 0.0f;   // the four loads, all issued before the additions below
        }
        sum += g[0] * g[0] + g[1] * g[1] + g[2] * g[2] + g[3] * g[3];
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half /= 2) {   // a tree in a fixed order: the same bits every run
        if (threadIdx.x < half) {
            partial[threadIdx.x] += partial[threadIdx.x + half];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partial_sums[blockIdx.x] = partial[0];
    }
}
