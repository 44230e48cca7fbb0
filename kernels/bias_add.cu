// y[n, c] += bias[c] for every row n of y, an array of (rows, columns) floats in row-major order:
// the "+ b" of y = x W^T + b. One thread per element.
extern "C" __global__ void bias_add(float* y, const float* bias, int rows, int columns)
{
    // A 64-bit index: rows * columns passes 2^31 for GPT-2's widest layers and large batches.
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)rows * columns) {
        y[i] += bias[i % columns];
    }
}
