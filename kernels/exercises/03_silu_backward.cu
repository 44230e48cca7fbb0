__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

extern "C" __global__ void silu_backward(float* dx, const float* x, const float* dy, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        float s = sigmoid(x[i]);
        dx[i] = dy[i] * (s + x[i] * s * (1.0f - s));  // sigma' = sigma (1 - sigma)
    }
}
