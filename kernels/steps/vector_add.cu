// out = a + b elementwise over n floats: GPT-2's residual connection on a flattened (B, T, C) tensor.

// One thread per element: launch ceil(n / blockDim.x) blocks (or more).
extern "C" __global__ void vector_add(float* out, const float* a, const float* b, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    // The grid has ceil(n / blockDim.x) blocks: the last one may have threads past the end.
    if (i < n) {
        out[i] = a[i] + b[i];
    }
}

// Any grid covers any n: each thread moves on by the number of threads in the whole grid, so that
// in every pass neighbouring threads still read neighbouring elements.
extern "C" __global__ void vector_add_grid_stride(float* out, const float* a, const float* b, int n)
{
    int stride = gridDim.x * blockDim.x;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        out[i] = a[i] + b[i];
    }
}
